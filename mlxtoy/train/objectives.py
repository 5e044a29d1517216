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

from mlxtoy.models.fastmath import (LOGITS_BY_COLUMNS, Linear, gemm, softmax_cross_entropy,
                                    softmax_cross_entropy_columns)
from mlxtoy.models.llama import LlamaModel, block_causal_mask
from mlxtoy.models.lora import lora_modules

STATS = ("loss", "reward_chosen", "reward_rejected", "pref_accuracy")


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    """Per-token cross-entropy logsumexp(logits) - logits[target], in float32 (no gradient
    bookkeeping: evaluation of models whose logits are not a plain projection)."""
    x = logits.astype(mx.float32)
    return mx.logsumexp(x, axis=-1) - mx.take_along_axis(x, targets[..., None], axis=-1)[..., 0]


def _chunk_spans(n_tokens: int, vocab: int, logits_per_chunk: int) -> list[tuple[int, int]]:
    # at most 32 chunks in the compiled graph
    size = max(-(-n_tokens // 32), logits_per_chunk // vocab, 1)
    return [(i, min(size, n_tokens - i)) for i in range(0, n_tokens, size)]


def _logits_per_chunk() -> int:
    # ~12M logits per chunk by columns (48 MB in float32), ~4M by rows
    return 12 << 20 if LOGITS_BY_COLUMNS else 1 << 22


def loss_logits_alive(n_tokens: int, vocab: int, weight_grad: bool) -> int:
    """Elements of vocabulary-wide arrays the fused loss holds at once: one chunk's logits and
    their gradient, and with `weight_grad` every token's gradient (kept for the output
    weight's). For the memory estimate."""
    spans = _chunk_spans(n_tokens, vocab, _logits_per_chunk())
    chunk = spans[0][1] if spans else 0
    return 2 * chunk * vocab + (n_tokens * vocab if weight_grad else 0)


def _chunked_ce(h: mx.array, w: mx.array, targets: mx.array, grads: bool,
                keep_dlogits: bool = False) -> tuple[list[mx.array], list[mx.array], list[mx.array]]:
    """Per chunk of tokens: the cross-entropy of h (N, D) through W (V, D), with `grads` the
    gradient (softmax - one-hot) @ W with respect to h, and with `keep_dlogits` softmax - one-hot
    itself, (n, V) per chunk, or (V, n) where the kernels take the logits by columns (the
    output GEMM W @ h.T is the faster one on CPU). Each chunk starts after the previous one's
    results, so one chunk's logits are alive at a time. -> (ce chunks, dh chunks, dlogits chunks)."""
    ces: list[mx.array] = []
    dhs: list[mx.array] = []
    dlogits: list[mx.array] = []
    grad = grads or keep_dlogits
    for i, n in _chunk_spans(h.shape[0], w.shape[0], _logits_per_chunk()):
        previous = ces[-1:] + dhs[-1:]
        hc = mx.depends(h[i:i + n], previous) if previous else h[i:i + n]
        if LOGITS_BY_COLUMNS:
            ce, d = softmax_cross_entropy_columns(gemm(hc, w, trans_b=True, trans_out=True), targets[i:i + n], grad)
        else:
            ce, d = softmax_cross_entropy(hc @ w.T, targets[i:i + n], grad)
        ces.append(ce)
        if grads:
            dhs.append(gemm(d.astype(w.dtype), w, trans_a=LOGITS_BY_COLUMNS))
        if keep_dlogits:
            dlogits.append(d.astype(w.dtype))
    return ces, dhs, dlogits


def _output_ce(weight_grad: bool):
    """The output projection and the cross-entropy as one function of (h, W, targets), with
    h (N, D), W (V, D): the logits are computed a chunk of tokens at a time and never held
    whole. The gradient with respect to h is a per-token factor times (softmax - one-hot) @ W,
    computed in the forward pass chunk by chunk, so the backward pass is one multiply; with
    `weight_grad` (a trained output layer) softmax - one-hot is kept for W's gradient."""

    @mx.custom_function
    def output_ce(h: mx.array, w: mx.array, targets: mx.array):
        ces, dhs, dlogits = _chunked_ce(h, w, targets, grads=True, keep_dlogits=weight_grad)
        out = [mx.concatenate(ces), mx.concatenate(dhs).astype(h.dtype)]
        if weight_grad:
            out.append(mx.concatenate(dlogits, axis=1 if LOGITS_BY_COLUMNS else 0))
        return tuple(out)

    @output_ce.vjp
    def output_ce_vjp(primals, cotangents, outputs):
        h, w, targets = primals
        c = cotangents[0][:, None]
        if weight_grad:
            d = outputs[2] if LOGITS_BY_COLUMNS else outputs[2].T  # (V, N)
            dw = gemm(d, (h * c).astype(w.dtype))
        else:
            dw = mx.zeros_like(w)
        return outputs[1] * c.astype(h.dtype), dw, mx.zeros_like(targets)

    return output_ce


_OUTPUT_CE = {flag: _output_ce(flag) for flag in (False, True)}


def output_cross_entropy(h: mx.array, w: mx.array, targets: mx.array, weight_grad: bool = False) -> mx.array:
    """Per-token cross-entropy of h (N, D) through the output weight W (V, D), differentiable
    (the fused chunked form; `weight_grad`: W's gradient is wanted too)."""
    return _OUTPUT_CE[weight_grad](h, w, targets)[0]


def output_layer(model: nn.Module) -> nn.Module | None:
    """The output layer when the model's logits are plainly h @ W.T (the fused loss applies),
    else None."""
    if type(model).logits is not LlamaModel.logits:
        return None
    layer = model.output if "output" in model else model.tok_embeddings
    if type(layer) not in (nn.Linear, Linear, nn.Embedding) or "bias" in layer:
        return None
    return layer


def token_losses(model: nn.Module, inputs: mx.array, targets: mx.array,
                 segments: mx.array | None = None, train: bool = True) -> mx.array:
    """Per-token cross-entropy (B, T); packed rows (segments given) use the block-causal mask.

    train: differentiable (the fused output loss's gradient); False: the same values with no
    gradient bookkeeping (evaluation, DPO's reference).
    """
    mask = block_causal_mask(segments) if segments is not None else None
    layer = output_layer(model)
    if layer is None:
        return cross_entropy(model(inputs, mask=mask), targets)
    h = model.hidden(inputs, mask=mask)
    B, T, D = h.shape
    flat_h, flat_t = h.reshape(B * T, D), targets.reshape(B * T)
    if not train:  # the same chunks and kernels as training, so values agree to the bit
        return mx.concatenate(_chunked_ce(flat_h, layer.weight, flat_t, grads=False)[0]).reshape(B, T)
    trained_w = "weight" in layer.trainable_parameters()
    return output_cross_entropy(flat_h, layer.weight, flat_t, trained_w).reshape(B, T)


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
