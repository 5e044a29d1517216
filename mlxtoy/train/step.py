"""The training step: schedule, optimizer, loss, and the compiled `Stepper`.

The step is compiled (`mx.compile` with the model, optimizer and RNG state as inputs and
outputs, as mlx-lm's tuner does): forward, token-weighted cross-entropy, backward, gradient
clipping and the optimizer update are one graph. Data-parallel training plugs in through a
`Reducer` (shard each global batch, all-reduce the gradients) instead of wrapping the step.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Protocol

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from mlxtoy.config import TrainConfig
from mlxtoy.models.llama import block_causal_mask
from mlxtoy.train.build import train_dtype
from mlxtoy.train.data import Batch, BatchStream


class Reducer(Protocol):
    """How a step spans several processes: each trains its shard of every global batch, and
    the gradients (and the evaluation sums) are combined before the update."""

    def shard(self, batch: Batch) -> Batch: ...

    def reduce(self, loss: mx.array, grads: Any) -> tuple[mx.array, Any]: ...

    def reduce_eval(self, total: float, count: int) -> tuple[float, int]: ...


def make_schedule(cfg: TrainConfig) -> Callable:
    decay_steps = max(1, cfg.steps - cfg.warmup)
    if cfg.schedule == "cosine":
        main = optim.cosine_decay(cfg.lr, decay_steps, cfg.min_lr)
    elif cfg.schedule == "linear":
        main = optim.linear_schedule(cfg.lr, cfg.min_lr, decay_steps)
    else:
        main = lambda step: mx.array(cfg.lr, dtype=mx.float32)  # noqa: E731
    if cfg.warmup <= 0:
        return main
    warmup, lr = cfg.warmup, cfg.lr

    def schedule(step):
        # the k-th update (step = k - 1 updates done) uses lr * k / warmup: no update at lr 0
        s = step.astype(mx.float32) if isinstance(step, mx.array) else mx.array(float(step))
        return mx.where(s < warmup, lr * (s + 1) / warmup, main(mx.maximum(s - warmup, 0)))

    return schedule


def make_optimizer(cfg: TrainConfig) -> optim.Optimizer:
    if cfg.optimizer == "sgd":  # plain SGD with momentum betas[0] (0 = none)
        return optim.SGD(learning_rate=make_schedule(cfg), momentum=cfg.betas[0],
                         weight_decay=cfg.weight_decay)
    return optim.AdamW(learning_rate=make_schedule(cfg), betas=list(cfg.betas), eps=cfg.eps,
                       weight_decay=cfg.weight_decay)


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


def batch_arrays(batch: Batch, packed: bool) -> tuple[mx.array, ...]:
    # Rows holding one document each (padding only at the end) need no block mask: the plain
    # causal mask gives the same losses, and the fused kernel skips a (B, H, T, T) select.
    segs = mx.array(batch.segments) if packed and batch.segments.max() > 0 else None
    return mx.array(batch.inputs), mx.array(batch.targets), mx.array(batch.weights), segs


def keep_if(ok: mx.array, tree: Any, old: Any) -> None:
    """In place: each array of `tree` (nested dicts / lists) becomes where(ok, new, old). In
    place because the compiled step reads its state back from these very containers."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in list(items):
        if isinstance(v, (dict, list)):
            keep_if(ok, v, old[k])
        elif isinstance(v, mx.array):
            tree[k] = mx.where(ok, v, old[k])


class Stepper:
    """The compiled training step (and evaluation), built once per model and optimizer."""

    def __init__(self, model: nn.Module, optimizer: optim.Optimizer, cfg: TrainConfig, packed: bool,
                 reducer: Reducer | None = None):
        self.model, self.optimizer, self.cfg, self.packed = model, optimizer, cfg, packed
        self.reducer = reducer
        clip = cfg.grad_clip

        # Mixed precision for full / scratch (LoRA: the frozen base is already stored in the
        # compute dtype): compute with a low-precision copy of the float32 master weights.
        low = train_dtype(cfg)
        mixed = cfg.method != "lora" and low != mx.float32

        def loss_fn(model, inputs, targets, weights, segments, norm):
            if mixed:
                master = model.trainable_parameters()
                model.update(tree_map(lambda p: p.astype(low), master))
            ce = token_losses(model, inputs, targets, segments)
            if mixed:
                model.update(master)  # the optimizer updates the float32 masters
            return (ce.astype(mx.float32) * weights).sum() / norm

        loss_and_grad = nn.value_and_grad(model, loss_fn)

        def finish(grads, loss):
            # A step whose loss or gradients are not finite is never applied: the update is
            # computed, then every weight and optimizer value is selected back to its old
            # value in the same graph (no extra copy held; the loop then stops or skips).
            if clip > 0:
                grads, gnorm = optim.clip_grad_norm(grads, clip)
            else:
                gnorm = mx.sqrt(sum(mx.sum(mx.square(g.astype(mx.float32))) for _, g in tree_flatten(grads)))
            ok = mx.isfinite(loss) & mx.isfinite(gnorm)
            old_params = model.trainable_parameters()
            old_state = tree_map(lambda v: v, optimizer.state)  # the same arrays, new containers
            optimizer.update(model, grads)
            model.update(tree_map(lambda new, old: mx.where(ok, new, old), model.trainable_parameters(),
                                  old_params))
            keep_if(ok, optimizer.state, old_state)
            return gnorm

        state = [model.state, optimizer.state, mx.random.state]

        @partial(mx.compile, inputs=state, outputs=state)
        def step(inputs, targets, weights, segments, norm):
            loss, grads = loss_and_grad(model, inputs, targets, weights, segments, norm)
            return loss, finish(grads, loss)

        @partial(mx.compile, inputs=state, outputs=state)
        def micro(inputs, targets, weights, segments, norm):
            return loss_and_grad(model, inputs, targets, weights, segments, norm)

        @partial(mx.compile, inputs=state, outputs=state)
        def apply(grads, loss):
            return finish(grads, loss)

        @partial(mx.compile, inputs=state)
        def eval_sum(inputs, targets, weights, segments):
            ce = token_losses(model, inputs, targets, segments, train=False)
            return (ce * weights).sum()

        # one fused graph for the common case; micro + apply for accumulation and reducers
        self.fused_step, self.micro, self.apply, self.eval_sum = step, micro, apply, eval_sum
        self.state = state

    def __call__(self, batches: list) -> tuple[mx.array, mx.array]:
        """One optimizer step over `batches` (grad_accum micro-batches) -> (loss, grad norm).

        The loss is the mean over every trained token of all micro-batches (token-weighted).
        """
        # normalised by the trained tokens of the whole (global) batch: with a reducer each
        # process's gradient is its share of the one-process mean, and their sum is that mean
        norm = mx.array(max(1, sum(b.n_loss for b in batches)), dtype=mx.float32)
        if len(batches) == 1 and self.reducer is None:
            return self.fused_step(*batch_arrays(batches[0], self.packed), norm)
        total, grads = None, None
        for b in batches:
            part = self.reducer.shard(b) if self.reducer is not None else b
            loss, g = self.micro(*batch_arrays(part, self.packed), norm)
            total = loss if total is None else total + loss
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(total, grads)  # bound memory: one micro-batch graph at a time
        if self.reducer is not None:
            total, grads = self.reducer.reduce(total, grads)
        return total, self.apply(grads, total)

    def evaluate(self, stream: BatchStream, n_batches: int) -> tuple[float, int]:
        """Mean token loss over the first `n_batches` validation batches (-1: all)."""
        total, count = 0.0, 0
        for b in stream.epoch_batches(n_batches):
            part = self.reducer.shard(b) if self.reducer is not None else b
            if part.inputs.shape[0] and part.n_loss:  # a shard of a short last batch may be empty
                total += self.eval_sum(*batch_arrays(part, self.packed)).item()
            count += part.n_loss
        if self.reducer is not None:
            total, count = self.reducer.reduce_eval(total, count)
        return (total / count if count else float("nan")), count
