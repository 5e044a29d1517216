"""Sampling: pure functions on logits (`apply_repetition_penalty`, `apply_top_k`, `apply_top_p`,
`apply_min_p`, `apply_temperature`), chained in llama.cpp's default order by `make_sampler`;
`SamplingParams` says which apply. OpenAI's frequency and presence penalties
(`apply_frequency_presence`) count a completion's own tokens, which the batched decoder keeps
per row (`mlxtoy.engine`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from mlxtoy.errors import UserError
from mlxtoy.models import fastmath


@dataclass
class SamplingParams:
    """How to pick the next token. temp == 0 is greedy (argmax after the penalty)."""

    temp: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    repetition_window: int = 64  # last N tokens (prompt included) that the penalty sees
    frequency_penalty: float = 0.0  # OpenAI's: minus this times a token's count so far
    presence_penalty: float = 0.0  # OpenAI's: minus this once a token has appeared
    seed: int | None = None  # None = fresh randomness each run

    def validate(self) -> "SamplingParams":
        if not self.temp >= 0:
            raise UserError(f"temperature must be >= 0, got {self.temp}")
        if self.top_k < 0:
            raise UserError(f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise UserError(f"min-p must be in [0, 1), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise UserError(f"repetition penalty must be > 0 (1 turns it off), got {self.repetition_penalty}")
        if self.repetition_window < 0:
            raise UserError(f"repetition window must be >= 0, got {self.repetition_window}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise UserError(f"{name.replace('_', ' ')} must be in -2..2, got {getattr(self, name)}")
        return self

    @property
    def counts_tokens(self) -> bool:
        """Whether sampling reads the counts of the tokens generated so far."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def apply_repetition_penalty(logits: mx.array, recent: mx.array | Sequence[int],
                             penalty: float) -> mx.array:
    """CTRL / llama.cpp penalty: each distinct recent token's logit is divided by `penalty`
    when positive and multiplied by it when negative (so > 1 always makes it less likely)."""
    if penalty == 1.0 or len(recent) == 0:
        return logits
    recent = mx.array(recent) if not isinstance(recent, mx.array) else recent
    seen = mx.zeros((logits.shape[-1],), dtype=mx.bool_)
    seen[recent] = True  # duplicates write the same value: each token is penalized once
    penalized = mx.where(logits > 0, logits / penalty, logits * penalty)
    return mx.where(seen, penalized, logits)


def apply_frequency_presence(logits: mx.array, counts: mx.array, frequency: float, presence: float) -> mx.array:
    """OpenAI's penalties: each token's logit minus frequency x its count among the tokens
    generated so far (`counts`, (V,)), minus presence once it has appeared at all."""
    return logits - (frequency * counts + presence * (counts > 0))


def apply_top_k(logits: mx.array, k: int) -> mx.array:
    """Keep the k largest logits, -inf elsewhere (exactly k, even with ties at the edge)."""
    vocab = logits.shape[-1]
    if k <= 0 or k >= vocab:
        return logits
    drop = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logits, drop, mx.array(-mx.inf, logits.dtype), axis=-1)


def apply_top_p(logits: mx.array, p: float) -> mx.array:
    """Nucleus: keep the most likely tokens whose probabilities first sum to >= p."""
    if p >= 1.0:
        return logits
    order = mx.argsort(-logits, axis=-1)
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)
    probs = mx.softmax(sorted_logits.astype(mx.float32), axis=-1)
    mass_before = mx.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < p  # the most likely token is always kept
    masked = mx.where(keep_sorted, sorted_logits, mx.array(-mx.inf, logits.dtype))
    return mx.put_along_axis(logits, order, masked, axis=-1)


def apply_min_p(logits: mx.array, min_p: float) -> mx.array:
    """Keep tokens with probability >= min_p * (probability of the most likely token)."""
    if min_p <= 0.0:
        return logits
    threshold = logits.max(axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logits >= threshold, logits, mx.array(-mx.inf, logits.dtype))


def apply_temperature(logits: mx.array, temp: float) -> mx.array:
    return logits if temp == 1.0 else logits / temp


Sampler = Callable[[mx.array, mx.array, "mx.array | None"], mx.array]


def make_sampler(params: SamplingParams) -> Sampler:
    """-> sampler(logits (B, V), recent tokens (N,), key) -> tokens (B,).

    Order as llama.cpp's default chain: penalty, top-k, top-p, min-p, temperature, draw.
    """
    params.validate()

    def sampler(logits: mx.array, recent: mx.array, key: mx.array | None) -> mx.array:
        logits = logits.astype(mx.float32)
        if params.repetition_penalty != 1.0 and params.repetition_window > 0:
            logits = apply_repetition_penalty(logits, recent, params.repetition_penalty)
        if params.greedy:
            return fastmath.argmax(logits)
        logits = apply_top_k(logits, params.top_k)
        logits = apply_top_p(logits, params.top_p)
        logits = apply_min_p(logits, params.min_p)
        logits = apply_temperature(logits, params.temp)
        return mx.random.categorical(logits, axis=-1, key=key)

    return sampler
