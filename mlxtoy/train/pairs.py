"""Preference pairs (DPO, ORPO): records -> tokenized pairs -> batches of whole pairs.

A pair is two examples, the chosen and the rejected completion of one prompt, each rendered
exactly as SFT renders that conversation (mlxtoy.train.formats.PairFormat): the loss mask
covers the completion and the end-of-turn tokens the chat template adds after it, never the
prompt. Records come from mlxtoy.train.records (the one reader of data files, kind "pref").

Batches hold `batch_size` pairs; pair j of a batch is sequences 2j (chosen) and 2j + 1
(rejected), and `Batch.seq` names each target's sequence so the objective can sum per-sequence
log-probabilities. Two layouts, with equal losses:
- packed (default): one row per pair, [chosen | rejected] as two documents of a block-causal
  row: the rejected tokens never see the chosen ones, and RoPE only sees relative positions,
  so each completion scores as it would alone, and no row is padded to the longer one;
- padded (--no-pack): rows chosen_1, rejected_1, chosen_2, rejected_2, ...
Either way a pair never spans two rows, so a data-parallel shard of rows holds whole pairs.
The order is a pure function of (seed, batch index), as for SFT batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlxtoy.errors import UserError
from mlxtoy.train.data import PAD_MULTIPLE, Batch, BatchStream, DataStats, Example, pack_rows
from mlxtoy.train.formats import Record, Renderer, as_trained


@dataclass
class Pair:
    chosen: Example
    rejected: Example
    where: str = ""

    def __len__(self) -> int:  # input tokens of both completions
        return len(self.chosen) + len(self.rejected)

    @property
    def trained(self) -> int:
        return self.chosen.trained + self.rejected.trained


def tokenize_pairs(records: list[Record], tokenizer, seq_len: int, mask_prompt: bool = True,
                   name: str = "train") -> tuple[list[Pair], DataStats]:
    """Records of kind "pref" -> pairs of at most seq_len + 1 tokens a side (longer ones are
    cut and counted; a pair whose prompt leaves no completion token is dropped and counted).

    mask_prompt is ignored: a preference loss never counts the prompt."""
    r = Renderer(tokenizer, True)
    out: list[Pair] = []
    stats = DataStats(dropped_why=f"the prompt leaves no room for the completion at seq_len {seq_len}")
    for rec in records:
        sides, cut = [], False
        for ids, loss in rec.format.sequences(rec, r):  # chosen, rejected
            cut = cut or len(ids) > seq_len + 1
            ids, loss = as_trained(ids, loss, seq_len)
            mask = np.asarray(loss, dtype=bool)
            sides.append(Example(np.asarray(ids, dtype=np.int32), mask, rec.where))
        if not all(e.loss.any() for e in sides):
            stats.dropped += 1
            continue
        stats.truncated += cut
        out.append(Pair(sides[0], sides[1], rec.where))
    if records and not out:
        raise UserError(f"{name}: no preference pair fits --seq-len {seq_len}: the prompt of every pair "
                        f"({stats.dropped}, e.g. {records[0].where}) leaves no room for its completion; "
                        f"raise --seq-len")
    stats.examples = len(out)
    stats.tokens = sum(len(p) for p in out)
    stats.loss_tokens = sum(p.trained for p in out)
    return out, stats


class PairStream(BatchStream):
    """Deterministic batches of `batch_size` whole pairs (see the module docstring).

    ref: (len(examples), 2) reference log-probabilities (chosen, rejected) handed out with each
    batch (full fine-tuning's stored reference); None gives zeros (LoRA computes its own)."""

    def __init__(self, pairs: list[Pair], batch_size: int, seq_len: int, seed: int = 0, pack: bool = True,
                 shuffle: bool = True, pad_id: int = 0, ref: np.ndarray | None = None):
        super().__init__(pairs, batch_size, seq_len, seed, pack, shuffle, pad_id)
        self.ref = ref

    def __post_init__(self):
        # one pair per "row" of the order: batch i takes batch_size pairs
        n = len(self.examples)
        self.rows = (pack_rows([len(p) for p in self.examples], self.seq_len, self.seed, pack=False)
                     if self.shuffle else [[i] for i in range(n)])

    def batch(self, index: int) -> Batch:
        idx = [row[0] for row in self._rows_for(index)]
        seqs = [ex for i in idx for ex in (self.examples[i].chosen, self.examples[i].rejected)]
        layout = [[2 * j, 2 * j + 1] for j in range(len(idx))] if self.pack else [[k] for k in range(len(seqs))]
        width = max(sum(len(seqs[k]) for k in row) for row in layout)
        cap = self.seq_len * len(layout[0])
        width = min(cap, -(-width // PAD_MULTIPLE) * PAD_MULTIPLE)
        B = len(layout)
        inputs = np.full((B, width), self.pad_id, dtype=np.int32)
        targets = np.zeros((B, width), dtype=np.int32)
        weights = np.zeros((B, width), dtype=np.float32)
        segments = np.full((B, width), -1, dtype=np.int32)
        seq = np.full((B, width), -1, dtype=np.int32)
        for b, row in enumerate(layout):
            pos = 0
            for d, k in enumerate(row):
                ex = seqs[k]
                n = len(ex)
                inputs[b, pos: pos + n] = ex.tokens[:-1]
                targets[b, pos: pos + n] = ex.tokens[1:]
                weights[b, pos: pos + n] = ex.loss[1:]
                segments[b, pos: pos + n] = d
                seq[b, pos: pos + n] = k
                pos += n
        ref = (self.ref[idx] if self.ref is not None else np.zeros((len(idx), 2))).astype(np.float32)
        return Batch(inputs, targets, weights, segments, int((segments >= 0).sum()), int(weights.sum()),
                     index, seq=seq, ref=ref, pairs=np.asarray(idx, dtype=np.int32),
                     n_chosen=sum(seqs[k].trained for k in range(0, len(seqs), 2)))
