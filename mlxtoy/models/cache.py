"""The KV cache: per layer, the keys and values of every token the model has already read.

Keys/values are stored (B, kv_heads, T, d_head), the layout attention consumes, in a buffer
whose length is a whole number of `step` positions (mlx-lm grows by steps too) so a decode step
writes one slot in place instead of concatenating a new array every token. `offset` counts the
valid positions; `trim(n)` forgets the last n of them (the buffer is kept), which is how a chat
session reuses the shared prefix of a conversation.

A batch of sequences of different lengths (`mlxtoy.engine`) shares one cache, its rows
left-padded: `starts[b]` is row b's first real column, so its own position of column c is
c - starts[b] (`positions`, what a learned position table reads) and its attention sees
columns starts[b] .. offset only. `join_rows` and `keep_rows` are how rows join and leave such
a cache between decode steps.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx


def rounded_capacity(positions: int, step: int) -> int:
    """The buffer length that holds `positions`: whole steps, whatever the prompt's length, so
    that caches of prompts of different lengths (each batch a server or GRPO decodes) have the
    same shapes and share the compiled decode's trace instead of paying a new one."""
    return -(-positions // step) * step


class KVCache:
    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.starts: mx.array | None = None  # (B,) int32: each row's first column (a batch), else None

    @property
    def positions(self) -> int | mx.array:
        """The position of the next token written: `offset`, or per row (B, 1) in a batch."""
        return self.offset if self.starts is None else (self.offset - self.starts)[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append keys/values (B, kv_heads, T, d_head); return everything cached so far."""
        prev, n_new = self.offset, keys.shape[2]
        self.reserve(n_new, like=(keys, values))
        self.offset += n_new
        self.keys[..., prev:self.offset, :] = keys
        self.values[..., prev:self.offset, :] = values
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reserve(self, n: int, like: tuple[mx.array, mx.array] | None = None) -> None:
        """Make room for n more positions, the buffers' length a whole number of steps
        (`rounded_capacity`).

        `like` gives (keys, values) to take batch, heads, widths and dtype from when the
        cache is still empty.
        """
        prev = self.offset
        if self.keys is not None and prev + n <= self.keys.shape[2]:
            return
        k_ref, v_ref = (self.keys, self.values) if like is None else like
        B, n_kv, _, d_k = k_ref.shape
        d_v = v_ref.shape[3]
        room = rounded_capacity(prev + n, self.step) - prev
        new_k = mx.zeros((B, n_kv, room, d_k), k_ref.dtype)
        new_v = mx.zeros((B, n_kv, room, d_v), v_ref.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            # Drop the unused tail (after a trim or a partial step) before growing.
            self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
            self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        """The arrays to `mx.eval` after a prefill chunk."""
        if self.keys is None:
            return ()
        return self.keys, self.values

    def trim(self, n: int) -> int:
        """Forget the last `n` cached positions; returns how many were actually dropped."""
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    def reset(self) -> None:
        self.offset = 0

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


class SlotCache:
    """A layer's cache inside the compiled decode step (`mlxtoy.generate`): the fixed-size
    buffers of a KVCache and the traced position `offset` (one int32) of the token being
    decoded. The new keys/values go into slot `offset`; the step's attention sees slots
    0..offset, which is all a block fusing its decode step may assume. `packed`: the layer's
    matrices in the packed form its fused step reads (see `Block.decode_packs`)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array,
                 packed: dict[str, mx.array] | None = None, starts: mx.array | None = None):
        self.keys, self.values, self.offset = keys, values, offset
        self.packed = packed or {}
        self.starts = starts  # (B,): each row's first column, as KVCache.starts

    @property
    def positions(self) -> mx.array:
        return self.offset if self.starts is None else (self.offset - self.starts)[:, None]

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write the position into slot `offset`; return the whole buffers (the attention
        mask hides the slots past the offset)."""
        self.keys = mx.slice_update(self.keys, k, self.offset, axes=(2,))
        self.values = mx.slice_update(self.values, v, self.offset, axes=(2,))
        return self.keys, self.values


def make_cache(model) -> list[KVCache]:
    """One empty KVCache per transformer layer of `model`."""
    return [KVCache() for _ in model.layers]


def cache_offset(cache: list[KVCache]) -> int:
    return cache[0].offset if cache else 0


def trim_cache(cache: list[KVCache], n: int) -> int:
    """Trim every layer's cache by n positions; returns the number trimmed."""
    trimmed = 0
    for c in cache:
        trimmed = c.trim(n)
    return trimmed


def cache_positions(cache: list | None) -> int | mx.array:
    """The position of the next token for a model's `embed`: 0 without a cache, else the
    first layer's `positions` (per row in a left-padded batch)."""
    return cache[0].positions if cache else 0


def _assembled(parts: list[tuple[mx.array, int, int]], rows: int, capacity: int) -> mx.array:
    """A (rows, heads, capacity, d) buffer of zeros with each (x, first row, first column) of
    `parts` written at its place: one copy of each part (where concatenating the rows and then
    growing the columns for the next token would copy every row twice)."""
    x = parts[0][0]
    out = mx.zeros((rows, x.shape[1], capacity, x.shape[3]), x.dtype)
    for part, row, column in parts:
        out = mx.slice_update(out, part, mx.array([row, 0, column, 0]), axes=(0, 1, 2, 3))
    return out


def join_rows(batch: list[KVCache], rows: list[KVCache], copies: int | Sequence[int] = 1) -> None:
    """Append copies of the rows of the cache `rows` (its `offset` columns; left-padded per its
    `starts` when it has them, else all real) to the batch cache `batch`, in place: row b
    `copies[b]` times (or each row `copies` times), and the shorter side left-padded so both
    end at the same column. An empty `batch` becomes the rows. The buffers get room for the
    next token (a decode step's)."""
    n_new = rows[0].offset
    n_rows = rows[0].keys.shape[0]
    counts = [copies] * n_rows if isinstance(copies, int) else list(copies)
    pick = None if all(n == 1 for n in counts) else mx.array([b for b, n in enumerate(counts) for _ in range(n)])
    end = max(batch[0].offset, n_new)
    pad_batch = end - batch[0].offset
    row_starts = rows[0].starts if rows[0].starts is not None else mx.zeros((n_rows,), mx.int32)
    new_starts = row_starts + (end - n_new)
    if pick is not None:
        new_starts = new_starts[pick]
    capacity = rounded_capacity(end + 1, KVCache.step)
    for b, r in zip(batch, rows):
        k_new, v_new = r.keys[..., :n_new, :], r.values[..., :n_new, :]
        if pick is not None:
            k_new, v_new = k_new[pick], v_new[pick]
        if b.keys is None or b.starts is None or b.starts.size == 0:
            old_rows, keys, values, starts = 0, [], [], new_starts
        else:
            old_rows = b.keys.shape[0]
            keys = [(b.keys[..., :b.offset, :], 0, pad_batch)]
            values = [(b.values[..., :b.offset, :], 0, pad_batch)]
            starts = mx.concatenate([b.starts + pad_batch, new_starts])
        total = old_rows + k_new.shape[0]
        b.keys = _assembled(keys + [(k_new, old_rows, end - n_new)], total, capacity)
        b.values = _assembled(values + [(v_new, old_rows, end - n_new)], total, capacity)
        b.starts = starts
        b.offset = end


def cache_columns(cache: list[KVCache], start: int = 0, end: int | None = None,
                  row: int | None = None) -> list[KVCache]:
    """A new cache of columns [start, end) (end: the filled ones) of every row, or of row `row`
    only: slices of the same arrays, copied only when evaluated."""
    rows = slice(None) if row is None else slice(row, row + 1)
    out = []
    for c in cache:
        stop = c.offset if end is None else end
        k = KVCache()
        k.keys, k.values = c.keys[rows, :, start:stop, :], c.values[rows, :, start:stop, :]
        k.offset = stop - start
        out.append(k)
    return out


def row_cache(cache: list[KVCache], row: int) -> list[KVCache]:
    """Row `row` of a left-padded batch cache as a one-row cache of its real columns only."""
    start = 0 if cache[0].starts is None else int(cache[0].starts[row].item())
    return cache_columns(cache, start, row=row)


def keep_rows(cache: list[KVCache], rows: list[int]) -> None:
    """Keep only these rows of a batch cache (in this order), then drop the leading columns
    that every kept row has as padding (the buffers with room for the next token)."""
    if not rows:
        for c in cache:
            c.keys = c.values = c.starts = None
            c.offset = 0
        return
    idx = mx.array(rows, dtype=mx.int32)
    n = int(cache[0].starts[idx].min().item())
    capacity = rounded_capacity(cache[0].offset - n + 1, KVCache.step)
    for c in cache:
        c.keys = _assembled([(c.keys[idx, :, n:c.offset], 0, 0)], len(rows), capacity)
        c.values = _assembled([(c.values[idx, :, n:c.offset], 0, 0)], len(rows), capacity)
        c.starts = c.starts[idx] - n
        c.offset -= n
