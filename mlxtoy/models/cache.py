"""The KV cache: per layer, the keys and values of every token the model has already read.

Keys/values are stored (B, kv_heads, T, d_head), the layout attention consumes, in a buffer
that grows in steps of `step` positions (as mlx-lm does) so a decode step writes one slot in
place instead of concatenating a new array every token. `offset` counts the valid positions;
`trim(n)` forgets the last n of them (the buffer is kept), which is how a chat session reuses
the shared prefix of a conversation.
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

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
        """Make room for n more positions, growing by whole steps.

        `like` gives (keys, values) to take batch, heads, widths and dtype from when the
        cache is still empty.
        """
        prev = self.offset
        if self.keys is not None and prev + n <= self.keys.shape[2]:
            return
        k_ref, v_ref = (self.keys, self.values) if like is None else like
        B, n_kv, _, d_k = k_ref.shape
        d_v = v_ref.shape[3]
        n_steps = (self.step + n - 1) // self.step
        new_k = mx.zeros((B, n_kv, n_steps * self.step, d_k), k_ref.dtype)
        new_v = mx.zeros((B, n_kv, n_steps * self.step, d_v), v_ref.dtype)
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
                 packed: dict[str, mx.array] | None = None):
        self.keys, self.values, self.offset = keys, values, offset
        self.packed = packed or {}

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
