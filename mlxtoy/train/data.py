"""Training data: records (mlxtoy.train.records) -> token examples -> packed (or padded) batches.

Each record is rendered by its format (mlxtoy.train.formats: the tokenizer's chat template where
there is one, the loss mask); a `.txt` stream is cut into windows of `seq_len` tokens.

Batches: by default several examples are packed into one row; `segments` holds each token's
document index in its row (-1 for padding) for `block_causal_mask`, so a token only sees
earlier tokens of its own document. With `pack=False` each row holds one example, padded.
The order is a pure function of (seed, batch index), so a checkpoint only records the index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from mlxtoy.errors import UserError
from mlxtoy.train.formats import Record, Renderer, as_trained
from mlxtoy.train.records import RawSplits, read_data

PAD_MULTIPLE = 32  # batch widths are rounded up to this (few distinct shapes to compile)


# ---------------------------------------------------------------------------------------------
# Tokenizing: records -> examples with a per-token loss mask
# ---------------------------------------------------------------------------------------------


@dataclass
class Example:
    tokens: np.ndarray  # int32 (L,)
    loss: np.ndarray  # bool (L,): token t is a prediction target
    where: str = ""

    def __len__(self) -> int:  # (input, target) pairs
        return len(self.tokens) - 1

    @property
    def trained(self) -> int:
        return int(self.loss[1:].sum())


@dataclass
class DataStats:
    examples: int = 0
    truncated: int = 0  # longer than seq_len + 1 tokens, cut
    dropped: int = 0  # nothing left to learn from (no target tokens)
    tokens: int = 0
    loss_tokens: int = 0
    dropped_why: str = "no trained tokens"

    def describe(self) -> str:
        # GRPO's prompts train none of their own tokens (the completions are sampled): no "(0 trained)"
        s = f"{self.examples} examples, {self.tokens} tokens" + (f" ({self.loss_tokens} trained)" if self.loss_tokens else "")
        if self.truncated:
            s += f", {self.truncated} truncated"
        if self.dropped:
            s += f", {self.dropped} dropped ({self.dropped_why})"
        return s


def tokenize(records: list[Record], tokenizer, seq_len: int, mask_prompt: bool = True,
             name: str = "train") -> tuple[list[Example], DataStats]:
    """Records -> examples of at most seq_len + 1 tokens (over-long ones truncated, counted)."""
    r = Renderer(tokenizer, mask_prompt)
    out: list[Example] = []
    stats = DataStats()
    for rec in records:
        fmt = rec.format
        ids, loss = fmt.sequences(rec, r)[0]
        if fmt.windowed:
            # one long text: consecutive windows sharing one boundary token, so every token
            # is predicted exactly once
            for s in range(0, max(1, len(ids) - 1), seq_len):
                chunk = np.asarray(ids[s: s + seq_len + 1], dtype=np.int32)
                if len(chunk) < 2:
                    continue
                out.append(Example(chunk, np.asarray(loss[s: s + seq_len + 1], dtype=bool), rec.where))
            continue
        stats.truncated += len(ids) > seq_len + 1
        ids, loss = as_trained(ids, loss, seq_len)
        loss = np.asarray(loss, dtype=bool)
        if len(ids) < 2 or not loss.any():
            stats.dropped += 1
            continue
        out.append(Example(np.asarray(ids, dtype=np.int32), loss, rec.where))
    # Truncating every example of a completion / chat set would cut the answers off: surely a
    # seq_len that is too small. Long plain texts are just cut (and counted), as mlx-lm does.
    if records and stats.truncated == len(records) and records[0].format.answer_at_end:
        raise UserError(f"{name}: every example ({len(records)}) is longer than seq_len {seq_len} "
                        f"tokens; raise --seq-len")
    if not out and records:
        raise UserError(f"{name}: no example has tokens to train on "
                        f"({stats.dropped} without any completion / assistant tokens)")
    stats.examples = len(out)
    stats.tokens = sum(len(e) for e in out)
    stats.loss_tokens = sum(e.trained for e in out)
    return out, stats


def split_examples(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Deterministic (seeded) train / valid split of one file's examples."""
    if fraction <= 0 or len(examples) < 2:
        return examples, []
    n_valid = min(len(examples) - 1, max(1, round(len(examples) * fraction)))
    perm = np.random.default_rng([seed, 0x5EED]).permutation(len(examples))
    valid_idx = set(perm[:n_valid].tolist())
    train = [e for i, e in enumerate(examples) if i not in valid_idx]
    valid = [e for i, e in enumerate(examples) if i in valid_idx]
    return train, valid


@dataclass
class Dataset:
    train: list[Example]
    valid: list[Example]
    test: list[Record]  # kept as records: accuracy needs prompts and answers
    valid_records: list[Record]
    train_stats: DataStats
    valid_stats: DataStats


def load_dataset(path: str, tokenizer, seq_len: int, mask_prompt: bool = True,
                 valid_fraction: float = 0.1, seed: int = 0, raw: RawSplits | None = None,
                 tokenize_fn: Callable = tokenize) -> Dataset:
    """Read and tokenize the splits (`tokenize_fn`: mlxtoy.train.pairs.tokenize_pairs for
    preference objectives); a single file's valid split is held out after tokenizing."""
    raw = raw or read_data(path)
    train, train_stats = tokenize_fn(raw.train, tokenizer, seq_len, mask_prompt, name=raw.train_path)
    valid_records = raw.valid or []
    if raw.valid is None:
        train, valid = split_examples(train, valid_fraction, seed)
        valid_stats = DataStats(examples=len(valid), tokens=sum(len(e) for e in valid),
                                loss_tokens=sum(e.trained for e in valid))
        train_stats.examples -= len(valid)
        # keep the records of the held-out examples for sample prompts
        held = {e.where for e in valid}
        valid_records = [r for r in raw.train if r.where in held and not r.format.windowed]
    else:
        valid, valid_stats = (tokenize_fn(raw.valid, tokenizer, seq_len, mask_prompt, name="valid")
                              if raw.valid else ([], DataStats()))
    return Dataset(train, valid, raw.test, valid_records, train_stats, valid_stats)


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


def pack_rows(lengths: list[int], seq_len: int, seed: int, pack: bool = True,
              window: int = 64) -> list[list[int]]:
    """Group example indices into rows of at most seq_len (input) tokens.

    Seeded shuffle, then first fit among the most recent `window` open rows (bounded work).
    """
    order = np.random.default_rng([seed, 0xB0C5]).permutation(len(lengths)).tolist()
    if not pack:
        return [[i] for i in order]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for j in range(max(0, len(rows) - window), len(rows)):
            if room[j] >= n:
                rows[j].append(i)
                room[j] -= n
                break
        else:
            rows.append([i])
            room.append(seq_len - n)
    return rows


@dataclass
class Batch:
    inputs: np.ndarray  # (B, T) int32
    targets: np.ndarray  # (B, T) int32
    weights: np.ndarray  # (B, T) float32: 1 where the target is trained
    segments: np.ndarray  # (B, T) int32: document index within the row, -1 = padding
    n_tokens: int = 0  # non-padding input tokens
    n_loss: int = 0  # trained targets
    index: int = 0  # global batch index (the data position)
    # preference pairs (mlxtoy.train.pairs): pair j of the batch is sequences 2j (chosen) and
    # 2j + 1 (rejected); `seq` says which sequence each target belongs to (-1: none)
    seq: np.ndarray | None = None  # (B, T) int32
    ref: np.ndarray | None = None  # (pairs, 2) float32: reference log-probs (chosen, rejected)
    pairs: np.ndarray | None = None  # (pairs,) int32: the pairs' indices in the dataset
    n_chosen: int = 0  # trained targets of the chosen completions
    # sampled completions (mlxtoy.train.grpo): one row each, prompt + completion
    advantages: np.ndarray | None = None  # (B,) float32
    positions: np.ndarray | None = None  # (B, C) int32: row positions of the completion's targets, -1 past
    old_logps: np.ndarray | None = None  # (B, C) float32: the generating policy's log-probs of them
    ref_logps: np.ndarray | None = None  # (B, C) float32: the reference's
    micro_tokens: int = 0  # the completion tokens of the whole micro-batch (a shard keeps the count)


@dataclass
class BatchStream:
    """Deterministic batches: batch i is a pure function of (examples, seed, i)."""

    examples: list[Example]
    batch_size: int
    seq_len: int
    seed: int = 0
    pack: bool = True
    shuffle: bool = True
    pad_id: int = 0
    rows: list[list[int]] = field(init=False)
    _perm_epoch: int = field(init=False, default=-1)
    _perm: np.ndarray | None = field(init=False, default=None)

    def __post_init__(self):
        if self.shuffle:
            self.rows = pack_rows([len(e) for e in self.examples], self.seq_len, self.seed, self.pack)
        else:
            # evaluation: fixed order, still packed so it costs what training costs
            self.rows = _pack_in_order([len(e) for e in self.examples], self.seq_len, self.pack)

    @property
    def batches_per_epoch(self) -> int:
        return max(1, math.ceil(len(self.rows) / self.batch_size))

    def _rows_for(self, index: int) -> list[list[int]]:
        epoch, j = divmod(index, self.batches_per_epoch)
        if not self.shuffle:
            return self.rows[j * self.batch_size: (j + 1) * self.batch_size]
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, 0xE90C, epoch]).permutation(len(self.rows))
            self._perm_epoch = epoch
        take = self._perm[j * self.batch_size: (j + 1) * self.batch_size].tolist()
        if len(take) < self.batch_size:  # every training batch is full: wrap around
            take += self._perm[: self.batch_size - len(take)].tolist()
            take = take[: self.batch_size]
            while len(take) < self.batch_size:  # fewer rows than batch_size
                take += take[: self.batch_size - len(take)]
        return [self.rows[k] for k in take]

    def batch(self, index: int) -> Batch:
        rows = self._rows_for(index)
        width = max(sum(len(self.examples[i]) for i in row) for row in rows)
        width = min(self.seq_len, -(-width // PAD_MULTIPLE) * PAD_MULTIPLE)
        B = len(rows)
        inputs = np.full((B, width), self.pad_id, dtype=np.int32)
        targets = np.zeros((B, width), dtype=np.int32)
        weights = np.zeros((B, width), dtype=np.float32)
        segments = np.full((B, width), -1, dtype=np.int32)
        for b, row in enumerate(rows):
            pos = 0
            for d, i in enumerate(row):
                ex = self.examples[i]
                n = len(ex)
                inputs[b, pos: pos + n] = ex.tokens[:-1]
                targets[b, pos: pos + n] = ex.tokens[1:]
                weights[b, pos: pos + n] = ex.loss[1:]
                segments[b, pos: pos + n] = d
                pos += n
        return Batch(inputs, targets, weights, segments, int((segments >= 0).sum()),
                     int(weights.sum()), index)

    def epoch_batches(self, limit: int = -1) -> Iterator[Batch]:
        n = self.batches_per_epoch if limit < 0 else min(limit, self.batches_per_epoch)
        for i in range(n):
            yield self.batch(i)


def _pack_in_order(lengths: list[int], seq_len: int, pack: bool) -> list[list[int]]:
    if not pack:
        return [[i] for i in range(len(lengths))]
    rows: list[list[int]] = []
    used = seq_len + 1
    for i, n in enumerate(lengths):
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows
