"""Per-token log-probabilities through the output layer, in chunks: the cross-entropy of
every objective (mlxtoy.train.objectives) without the [tokens x vocabulary] logits ever
existing whole, in float32, with a hand-written gradient (`output_cross_entropy`), and the
no-gradient forms evaluation and references use (the same chunks and kernels: the same bits).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from mlxtoy.models.cross_entropy import logits_by_columns, softmax_cross_entropy, softmax_cross_entropy_columns
from mlxtoy.models.fastmath import Linear, gemm
from mlxtoy.models.llama import LlamaModel, block_causal_mask
from mlxtoy.models.quant import QUANTIZED_TYPES, quantized_input_grad, quantized_linear


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    """Per-token cross-entropy logsumexp(logits) - logits[target], in float32 (no gradient
    bookkeeping: evaluation of models whose logits are not a plain projection)."""
    x = logits.astype(mx.float32)
    return mx.logsumexp(x, axis=-1) - mx.take_along_axis(x, targets[..., None], axis=-1)[..., 0]


def _chunk_spans(n_tokens: int, vocab: int, logits_per_chunk: int) -> list[tuple[int, int]]:
    # at most 32 chunks in the compiled graph
    size = max(-(-n_tokens // 32), logits_per_chunk // vocab, 1)
    return [(i, min(size, n_tokens - i)) for i in range(0, n_tokens, size)]


def _logits_per_chunk(by_columns: bool) -> int:
    # ~12M logits per chunk by columns (48 MB in float32), ~4M by rows
    return 12 << 20 if by_columns else 1 << 22


def loss_logits_alive(n_tokens: int, vocab: int, weight_grad: bool, quantized: bool = False) -> int:
    """Elements of vocabulary-wide arrays the fused loss holds at once: one chunk's logits and
    their gradient, and with `weight_grad` every token's gradient (kept for the output
    weight's). `quantized`: the output layer is (its logits come by rows). For the memory
    estimate."""
    spans = _chunk_spans(n_tokens, vocab, _logits_per_chunk(logits_by_columns() and not quantized))
    chunk = spans[0][1] if spans else 0
    return 2 * chunk * vocab + (n_tokens * vocab if weight_grad else 0)


class OutputWeights:
    """The output layer's frozen or trained weight as the fused loss multiplies it: a float
    matrix W (V, D), or W kept quantized (a QLoRA base's tied embedding or output layer, whose
    logits and input gradient are the quantized products; it is never trained)."""

    def __init__(self, layer: nn.Module):
        self.quant = (layer.group_size, layer.bits) if isinstance(layer, QUANTIZED_TYPES) else None
        self.arrays = (layer.weight, layer.scales, layer.biases) if self.quant else (layer.weight,)
        self.trained = not self.quant and "weight" in layer.trainable_parameters()

    @property
    def vocab(self) -> int:
        return self.arrays[0].shape[0]


def _chunked_ce(h: mx.array, ws: tuple[mx.array, ...], quant: tuple[int, int] | None, targets: mx.array,
                grads: bool, keep_dlogits: bool = False
                ) -> tuple[list[mx.array], list[mx.array], list[mx.array]]:
    """Per chunk of tokens: the cross-entropy of h (N, D) through W (V, D) (`ws`: (W,), or its
    quantized (weight, scales, biases) with `quant` = (group size, bits)), with `grads` the
    gradient (softmax - one-hot) @ W with respect to h, and with `keep_dlogits` softmax - one-hot
    itself, (n, V) per chunk, or (V, n) where the kernels take a float W's logits by columns
    (the output GEMM W @ h.T is the faster one on CPU). Each chunk starts after the previous
    one's results, so one chunk's logits are alive at a time. -> (ce, dh, dlogits chunks)."""
    ces: list[mx.array] = []
    dhs: list[mx.array] = []
    dlogits: list[mx.array] = []
    grad = grads or keep_dlogits
    by_columns = logits_by_columns() and quant is None
    w = ws[0]
    for i, n in _chunk_spans(h.shape[0], w.shape[0], _logits_per_chunk(by_columns)):
        previous = ces[-1:] + dhs[-1:]
        hc = mx.depends(h[i:i + n], previous) if previous else h[i:i + n]
        if quant:
            ce, d = softmax_cross_entropy(quantized_linear(hc, *ws, *quant), targets[i:i + n], grad)
        elif by_columns:
            ce, d = softmax_cross_entropy_columns(gemm(hc, w, trans_b=True, trans_out=True), targets[i:i + n], grad)
        else:
            ce, d = softmax_cross_entropy(hc @ w.T, targets[i:i + n], grad)
        ces.append(ce)
        if grads:
            dhs.append(quantized_input_grad(d.astype(h.dtype), *ws, *quant) if quant
                       else gemm(d.astype(w.dtype), w, trans_a=by_columns))
        if keep_dlogits:
            dlogits.append(d.astype(w.dtype))
    return ces, dhs, dlogits


@functools.lru_cache(maxsize=None)
def _output_ce(weight_grad: bool, quant: tuple[int, int] | None):
    """The output projection and the cross-entropy as one function of (h, targets, *W), with
    h (N, D), W (V, D) (or its quantized arrays): the logits are computed a chunk of tokens at a
    time and never held whole. The gradient with respect to h is a per-token factor times
    (softmax - one-hot) @ W, computed in the forward pass chunk by chunk, so the backward pass
    is one multiply; with `weight_grad` (a trained output layer) softmax - one-hot is kept for
    W's gradient."""

    @mx.custom_function
    def output_ce(h: mx.array, targets: mx.array, *ws: mx.array):
        ces, dhs, dlogits = _chunked_ce(h, ws, quant, targets, grads=True, keep_dlogits=weight_grad)
        out = [mx.concatenate(ces), mx.concatenate(dhs).astype(h.dtype)]
        if weight_grad:
            out.append(mx.concatenate(dlogits, axis=1 if logits_by_columns() else 0))
        return tuple(out)

    @output_ce.vjp
    def output_ce_vjp(primals, cotangents, outputs):
        h, targets, *ws = primals
        c = cotangents[0][:, None]
        if weight_grad:
            d = outputs[2] if logits_by_columns() else outputs[2].T  # (V, N)
            dws = [gemm(d, (h * c).astype(ws[0].dtype))]
        else:
            dws = [mx.zeros_like(w) for w in ws]
        return (outputs[1] * c.astype(h.dtype), mx.zeros_like(targets), *dws)

    return output_ce


def calibrate_loss(n_tokens: int, vocab: int, d_model: int) -> None:
    """Measure (where not yet measured, or due a second look: `RouteTable.due`) the routes of
    the products that a training step's loss over `n_tokens` tokens through a float32 output
    layer (vocab, d_model) takes, its weight trained and frozen (`doctor --calibrate`, beside
    `calibrate.calibrate`): the routes are chosen as the graph is built, so the graph is built
    and never run."""
    h, w = mx.zeros((n_tokens, d_model)), mx.zeros((vocab, d_model))
    targets = mx.zeros((n_tokens,), dtype=mx.uint32)
    for trained in (True, False):
        mx.vjp(lambda h, w: [_output_ce(trained, None)(h, targets, w)[0]], [h, w], [mx.ones((n_tokens,))])


def output_cross_entropy(h: mx.array, weights: OutputWeights, targets: mx.array) -> mx.array:
    """Per-token cross-entropy of h (N, D) through the output layer's weights, differentiable
    (the fused chunked form; W's gradient too where the layer is trained)."""
    return _output_ce(weights.trained, weights.quant)(h, targets, *weights.arrays)[0]


def chunked_cross_entropy(h: mx.array, weights: OutputWeights, targets: mx.array) -> mx.array:
    """`output_cross_entropy`'s values with no gradient bookkeeping (the same chunks and
    kernels, so the same bits): evaluation, references, stored log-probs."""
    return mx.concatenate(_chunked_ce(h, weights.arrays, weights.quant, targets, grads=False)[0])


def output_layer(model: nn.Module) -> nn.Module | None:
    """The output layer when the model's logits are plainly h @ W.T (the fused loss applies),
    else None."""
    if type(model).logits is not LlamaModel.logits:
        return None
    layer = model.output if "output" in model else model.tok_embeddings
    if type(layer) not in (nn.Linear, Linear, nn.Embedding, *QUANTIZED_TYPES) or "bias" in layer:
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
    weights = OutputWeights(layer)
    if not train:  # the same chunks and kernels as training, so values agree to the bit
        return chunked_cross_entropy(flat_h, weights, flat_t).reshape(B, T)
    return output_cross_entropy(flat_h, weights, flat_t).reshape(B, T)


def _entropy(logits: mx.array) -> mx.array:
    x = logits.astype(mx.float32)
    lse = mx.logsumexp(x, axis=-1, keepdims=True)
    return lse[..., 0] - (mx.exp(x - lse) * x).sum(-1)


def _gather_rows(x: mx.array, positions: mx.array) -> mx.array:
    """x (B, T, ...) at positions (B, C) of its second axis -> (B, C, ...)."""
    idx = positions.reshape(*positions.shape, *([1] * (x.ndim - 2)))
    return mx.take_along_axis(x, mx.broadcast_to(idx, (*positions.shape, *x.shape[2:])), axis=1)


def completion_logps(model: nn.Module, inputs: mx.array, positions: mx.array, targets: mx.array,
                     train: bool = True, entropy: bool = True,
                     temperature: float = 1.0) -> tuple[mx.array, mx.array | None]:
    """GRPO's log-probabilities: the forward pass reads whole rows `inputs` (B, T) (prompt and
    sampled completion ids), and the output layer runs only at `positions` (B, C), the rows'
    completion tokens (as TRL's logits_to_keep), giving (B, C) float32 log-probs of `targets`
    (B, C), in chunks; train: differentiable (the fused output loss), False: the same values
    with no gradient bookkeeping (the stored log-probs: equal to the bit). With `entropy`, each
    position's entropy over the vocabulary too (no gradient), else None. `temperature`: of the
    distribution the completions were sampled from, logits / temperature (as TRL does)."""
    layer = output_layer(model)
    if layer is None:
        logits = _gather_rows(model(inputs), positions)
        logits = logits if temperature == 1.0 else logits.astype(mx.float32) / temperature
        logp = -cross_entropy(logits, targets)
        return logp, mx.stop_gradient(_entropy(logits)) if entropy else None
    h = _gather_rows(model.hidden(inputs), positions)
    if temperature != 1.0:  # the logits are h @ W.T: scaling h scales them
        h = h / temperature
    B, C, D = h.shape
    flat_h, flat_t, weights = h.reshape(B * C, D), targets.reshape(B * C), OutputWeights(layer)
    if train:
        logp = -output_cross_entropy(flat_h, weights, flat_t)
    else:
        logp = -chunked_cross_entropy(flat_h, weights, flat_t)
    if not entropy:
        return logp.reshape(B, C), None
    hs, ws = mx.stop_gradient(flat_h), [mx.stop_gradient(w) for w in weights.arrays]
    parts: list[mx.array] = []
    for i, n in _chunk_spans(B * C, weights.vocab, _logits_per_chunk(logits_by_columns() and not weights.quant)):
        hc = mx.depends(hs[i:i + n], parts[-1:]) if parts else hs[i:i + n]  # one chunk's logits at a time
        logits = quantized_linear(hc, *ws, *weights.quant) if weights.quant else gemm(hc, ws[0], trans_b=True)
        parts.append(_entropy(logits))
    return logp.reshape(B, C), mx.concatenate(parts).reshape(B, C)
