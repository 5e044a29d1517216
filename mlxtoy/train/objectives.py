"""The training objectives: what a batch's loss is (the Stepper compiles and differentiates it).

- sft: token-weighted cross-entropy (`token_losses`, with a hand-written fast gradient).
- dpo (Rafailov et al. 2023, TRL's sigmoid loss with label smoothing eps): with per-sequence
  summed completion log-probabilities pi_c, pi_r of the policy and ref_c, ref_r of the
  reference, z = beta * ((pi_c - pi_r) - (ref_c - ref_r)),
      loss = -(1 - eps) * log sigmoid(z) - eps * log sigmoid(-z)     (mean over pairs),
  rewards beta * (pi - ref) (detached). The reference is the frozen starting point: with LoRA
  the same model with its adapters switched off (`adapters_disabled`), otherwise log-probs
  computed once before step 1 (`Batch.ref`).
- orpo (Hong et al. 2024, TRL's convention): with mean per-token completion log-probs
  a_c, a_r, log_odds = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)),
      loss = NLL(chosen completion tokens, mean over tokens) - beta * mean log sigmoid(log_odds),
  rewards beta * a (detached). No reference. (TRL's NLL also covers the prompt; here, as for
  every objective, the prompt is never trained.)

Every sum is divided by a count of the whole optimizer step (pairs, chosen tokens) computed
on the host, so micro-batches and data-parallel shards add up to the one-batch result.
`preference_loss` returns (loss, stats) where stats = [loss, reward_chosen, reward_rejected,
pref_accuracy] in that additive form.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from mlxtoy.models.llama import block_causal_mask
from mlxtoy.models.lora import lora_modules

STATS = ("loss", "reward_chosen", "reward_rejected", "pref_accuracy")


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    """Per-token cross-entropy logsumexp(logits) - logits[target], in float32 (no gradient
    bookkeeping: evaluation)."""
    x = logits.astype(mx.float32)
    return mx.logsumexp(x, axis=-1) - mx.take_along_axis(x, targets[..., None], axis=-1)[..., 0]


@mx.custom_function
def _cross_entropy_train(logits: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    """(per-token cross-entropy, softmax): the softmax is kept for the backward pass.

    Exponentials are slow on CPU (a scalar libm call per element; 50M of them per step for
    SmolLM2 at 4 x 256 tokens), so the forward's softmax is reused instead of recomputed, and
    the gradient is written directly (softmax - one-hot) rather than through the generic
    logsumexp and gather VJPs. Measured on the SmolLM2 head: -0.35 s per step and half the
    peak memory of `nn.losses.cross_entropy`.
    """
    x = logits.astype(mx.float32)
    m = mx.stop_gradient(x.max(axis=-1, keepdims=True))
    e = mx.exp(x - m)
    s = e.sum(axis=-1, keepdims=True)
    picked = mx.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    return (m + mx.log(s))[..., 0] - picked, e / s


@_cross_entropy_train.vjp
def _cross_entropy_vjp(primals, cotangents, outputs):
    logits, targets = primals
    c = cotangents[0][..., None]
    g = outputs[1] * c
    g = mx.where(mx.arange(logits.shape[-1]) == targets[..., None], g - c, g)
    return g.astype(logits.dtype), mx.zeros_like(targets)


def token_losses(model: nn.Module, inputs: mx.array, targets: mx.array,
                 segments: mx.array | None = None, train: bool = True) -> mx.array:
    """Per-token cross-entropy (B, T); packed rows (segments given) use the block-causal mask.

    train: use the loss with the fast hand-written gradient (False: plain, for evaluation).
    """
    mask = block_causal_mask(segments) if segments is not None else None
    logits = model(inputs, mask=mask)
    if train:
        return _cross_entropy_train(logits, targets)[0]
    return cross_entropy(logits, targets)


def sft_loss(model: nn.Module, inputs: mx.array, targets: mx.array, weights: mx.array,
             segments: mx.array | None, norm: mx.array) -> mx.array:
    """Token-weighted cross-entropy sum / norm (the trained tokens of the whole step)."""
    ce = token_losses(model, inputs, targets, segments)
    return (ce.astype(mx.float32) * weights).sum() / norm


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The model without its LoRA adapters (the frozen base: DPO's reference), no copy made."""
    mods = [m for _, m in lora_modules(model)]
    for m in mods:
        m.disabled = True
    try:
        yield
    finally:
        for m in mods:
            m.disabled = False


def sequence_logps(tok_logp: mx.array, weights: mx.array, seq: mx.array, n_seqs: int) -> tuple[mx.array, mx.array]:
    """Per-sequence sums of the trained tokens' log-probs, and their token counts (n_seqs,)."""
    onehot = (seq.reshape(-1, 1) == mx.arange(n_seqs)[None, :]).astype(mx.float32)
    w = weights.reshape(-1)
    return (tok_logp.reshape(-1) * w) @ onehot, w @ onehot


def dpo_terms(pc: mx.array, pr: mx.array, rc: mx.array, rr: mx.array, beta: float,
              label_smoothing: float = 0.0) -> tuple[mx.array, mx.array, mx.array]:
    """Per-pair DPO sigmoid losses and the (detached) rewards of chosen and rejected."""
    z = beta * ((pc - pr) - (rc - rr))
    losses = -(1 - label_smoothing) * nn.log_sigmoid(z) - label_smoothing * nn.log_sigmoid(-z)
    return losses, mx.stop_gradient(beta * (pc - rc)), mx.stop_gradient(beta * (pr - rr))


def _log1m_exp(a: mx.array) -> mx.array:
    # log(1 - e^a) for a < 0; a is kept below 0 so that a completion of probability 1 in
    # float32 gives a large finite value instead of -inf (and a NaN gradient)
    return mx.log(-mx.expm1(mx.minimum(a, -1e-7)))


def orpo_terms(ac: mx.array, ar: mx.array, beta: float) -> tuple[mx.array, mx.array, mx.array]:
    """Per-pair ORPO odds-ratio terms -beta * log sigmoid(log_odds) (mean per-token log-probs
    in), and the rewards beta * a (detached)."""
    log_odds = (ac - ar) - (_log1m_exp(ac) - _log1m_exp(ar))
    return -beta * nn.log_sigmoid(log_odds), mx.stop_gradient(beta * ac), mx.stop_gradient(beta * ar)


@dataclass(frozen=True)
class PreferenceSpec:
    objective: str  # dpo | orpo
    beta: float
    label_smoothing: float = 0.0
    adapters_reference: bool = False  # dpo with LoRA: the reference is the model without adapters


def preference_loss(model: nn.Module, spec: PreferenceSpec, inputs: mx.array, targets: mx.array,
                    weights: mx.array, segments: mx.array | None, seq: mx.array, ref: mx.array,
                    norms: mx.array, train: bool = True) -> tuple[mx.array, mx.array]:
    """(loss, stats) of a batch of pairs (see the module docstring).

    ref: (P, 2) reference log-probs (used unless spec.adapters_reference); its shape gives the
    number of pairs P. norms: [pairs, chosen trained tokens] of the whole step.
    """
    P = ref.shape[0]
    tok = -token_losses(model, inputs, targets, segments, train).astype(mx.float32)
    lp, cnt = sequence_logps(tok, weights, seq, 2 * P)
    lp, cnt = lp.reshape(P, 2), cnt.reshape(P, 2)
    present = (cnt[:, 0] > 0).astype(mx.float32)  # a data-parallel shard holds some pairs only
    if spec.objective == "dpo":
        if spec.adapters_reference:
            with adapters_disabled(model):
                # the same loss function as the policy's: at step 0 the two agree to the bit
                ref_tok = -token_losses(model, inputs, targets, segments, train)
            ref = mx.stop_gradient(sequence_logps(ref_tok, weights, seq, 2 * P)[0].reshape(P, 2))
        losses, rc, rr = dpo_terms(lp[:, 0], lp[:, 1], ref[:, 0], ref[:, 1], spec.beta, spec.label_smoothing)
        loss = (losses * present).sum() / norms[0]
    else:
        avg = lp / mx.maximum(cnt, 1)
        terms, rc, rr = orpo_terms(avg[:, 0], avg[:, 1], spec.beta)
        nll = -(lp[:, 0] * present).sum() / norms[1]
        loss = nll + (terms * present).sum() / norms[0]
    stats = mx.stack([loss, (rc * present).sum() / norms[0], (rr * present).sum() / norms[0],
                      ((rc > rr).astype(mx.float32) * present).sum() / norms[0]])
    return loss, stats


def pair_logps(model: nn.Module, inputs: mx.array, targets: mx.array, weights: mx.array,
               segments: mx.array | None, seq: mx.array, n_pairs: int) -> mx.array:
    """(P, 2) summed completion log-probs (chosen, rejected): full fine-tuning's reference."""
    tok = -token_losses(model, inputs, targets, segments)  # the training forward, bit for bit
    return sequence_logps(tok, weights, seq, 2 * n_pairs)[0].reshape(n_pairs, 2)
