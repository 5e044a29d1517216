"""The preference losses (DPO, ORPO) and the reference they compare with; the objectives
(mlxtoy.train.objectives.DPO / ORPO) plug them into the trainer, as grpo.py's math is GRPO's.

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

`preference_loss` returns (loss, stats) where stats = STATS = [loss, reward_chosen,
reward_rejected, pref_accuracy], each a share of the step's mean (pairs counted on the host),
so micro-batches and data-parallel shards add up to the one-batch result.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from mlxtoy.models.lora import lora_modules
from mlxtoy.train.logprobs import token_losses

STATS = ("loss", "reward_chosen", "reward_rejected", "pref_accuracy")


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
                # the same values as the policy's (token_losses): at step 0 they agree to the bit
                ref_tok = -token_losses(model, inputs, targets, segments, train=False)
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
    tok = -token_losses(model, inputs, targets, segments, train=False)  # the training values, bit for bit
    return sequence_logps(tok, weights, seq, 2 * n_pairs)[0].reshape(n_pairs, 2)


