"""The training step: schedule, optimizer, loss, and the compiled `Stepper`.

The step is compiled (`mx.compile` with the model, optimizer and RNG state as inputs and
outputs, as mlx-lm's tuner does): forward, the objective's loss (mlxtoy.train.objectives: SFT's
token-weighted cross-entropy, DPO, ORPO, GRPO), backward, gradient clipping and the optimizer
update are one graph. Data-parallel training plugs in through a
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
from mlxtoy.models import fastmath
from mlxtoy.train.build import train_dtype
from mlxtoy.train.data import Batch, BatchStream
from mlxtoy.train.objectives import Objective, batch_arrays, make_objective, pair_arrays, token_losses

__all__ = ["GuardedAdamW", "MatrixMuon", "Reducer", "Stepper", "batch_arrays", "block_matrix", "make_optimizer", "make_schedule",
           "pair_arrays", "token_losses"]


class Reducer(Protocol):
    """How a step spans several processes: each trains its shard of every global batch, and
    the gradients (and the evaluation sums) are combined before the update."""

    def shard(self, batch: Batch) -> Batch: ...

    def reduce(self, loss: mx.array, grads: Any, extremes: dict[int, str] | None = None) -> tuple[mx.array, Any]: ...

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


class MatrixMuon(optim.Muon):
    """Muon that orthogonalises a stacked weight as the matrix it multiplies by: our per-head
    projections are (heads, d_head, d_model), which MLX's Muon would flatten to
    (heads, d_head * d_model) instead of (heads * d_head, d_model)."""

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        shape = parameter.shape
        if len(shape) <= 2:
            return super().apply_single(gradient, parameter, state)
        flat = {"v": state["v"].reshape(-1, shape[-1])}
        out = super().apply_single(gradient.reshape(-1, shape[-1]), parameter.reshape(-1, shape[-1]), flat)
        state["v"] = flat["v"].reshape(shape)
        return out.reshape(shape)


class GuardedAdamW(optim.AdamW):
    """AdamW whose step can be withheld and whose gradients can be scaled (clipping): set for
    one `update`, `ok` (a boolean array) False keeps every weight and moment at its old value,
    and `grad_scale` multiplies the gradients first. On CPU with the kernels the scaling, the
    update and that choice are one threaded pass per weight (`fastmath.adamw_step`, the same
    bits as mlx.optimizers.AdamW); elsewhere MLX's ops and a select."""

    ok: mx.array | None = None
    grad_scale: mx.array | None = None

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        ok = self.ok if self.ok is not None else mx.array(True)
        if not self.bias_correction:
            out = fastmath.adamw_step(parameter, gradient, state["m"], state["v"],
                                      self.learning_rate.astype(gradient.dtype), ok, self.grad_scale,
                                      tuple(self.betas), self.eps, self.weight_decay)
            if out is not None:
                new, state["m"], state["v"] = out
                return new
        if self.grad_scale is not None:
            gradient = gradient * self.grad_scale.astype(gradient.dtype)
        old_m, old_v = state["m"], state["v"]
        new = super().apply_single(gradient, parameter, state)
        if self.ok is None:
            return new
        state["m"], state["v"] = mx.where(ok, state["m"], old_m), mx.where(ok, state["v"], old_v)
        return mx.where(ok, new, parameter)


def block_matrix(path: str, weight: mx.array) -> bool:
    """What Muon updates: the blocks' matrices (embeddings, output and vectors take AdamW)."""
    return path.startswith("layers.") and weight.ndim >= 2


def make_optimizer(cfg: TrainConfig) -> optim.Optimizer:
    """cfg.optimizer from mlx.optimizers, on cfg's learning-rate schedule."""
    lr, wd, name = make_schedule(cfg), cfg.weight_decay, cfg.optimizer
    if name == "sgd":
        return optim.SGD(learning_rate=lr, momentum=cfg.momentum, weight_decay=wd, nesterov=cfg.nesterov)
    if name == "adam":
        return optim.Adam(learning_rate=lr, betas=list(cfg.betas), eps=cfg.eps)
    if name == "adafactor":  # on our schedule, not Adafactor's own relative step size
        return optim.Adafactor(learning_rate=lr, weight_decay=wd, relative_step=False, scale_parameter=False)
    if name == "lion":
        return optim.Lion(learning_rate=lr, betas=list(cfg.betas), weight_decay=wd)
    if name == "muon":
        muon = MatrixMuon(learning_rate=lr, momentum=cfg.momentum, weight_decay=wd, nesterov=cfg.nesterov)
        adamw = optim.AdamW(learning_rate=lr, betas=list(cfg.betas), eps=cfg.eps, weight_decay=wd)
        return optim.MultiOptimizer([muon, adamw], [block_matrix])
    return GuardedAdamW(learning_rate=lr, betas=list(cfg.betas), eps=cfg.eps, weight_decay=wd)


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
    """The compiled training step (and evaluation), built once per model and optimizer.

    A step returns (out, grad norm): `out` is what the objective's `value` makes of its loss
    function's output: the loss for SFT, a vector of statistics (loss first) for the others."""

    def __init__(self, model: nn.Module, optimizer: optim.Optimizer, cfg: TrainConfig, packed: bool,
                 reducer: Reducer | None = None, objective: Objective | None = None):
        self.model, self.optimizer, self.cfg, self.packed = model, optimizer, cfg, packed
        self.reducer = reducer
        self.objective = objective = objective or make_objective(cfg.resolve_beta())
        clip = cfg.grad_clip

        # Mixed precision for full / scratch (LoRA: the frozen base is already stored in the
        # compute dtype): compute with a low-precision copy of the float32 master weights.
        low = train_dtype(cfg)
        mixed = not cfg.adapters and low != mx.float32

        def loss_fn(model, *args):
            if mixed:
                master = model.trainable_parameters()
                model.update(tree_map(lambda p: p.astype(low), master))
            out = objective.loss(model, *args)
            if mixed:
                model.update(master)  # the optimizer updates the float32 masters
            return out

        loss_and_grad = nn.value_and_grad(model, loss_fn)
        value, scalar = objective.value, objective.scalar  # what a step returns; the loss in it

        def guarded_finish(grads, loss):
            # GuardedAdamW clips, updates and keeps the old values itself, in one pass per weight
            gnorm = mx.sqrt(sum(fastmath.sum_squares(g) for _, g in tree_flatten(grads)))
            ok = mx.isfinite(loss) & mx.isfinite(gnorm)
            # its own scalars (step count, learning rate): the per-weight state it guards itself
            old_scalars = {k: v for k, v in optimizer.state.items() if isinstance(v, mx.array)}
            optimizer.ok = ok
            optimizer.grad_scale = mx.minimum(clip / (gnorm + 1e-6), 1.0) if clip > 0 else None
            optimizer.update(model, grads)
            optimizer.ok = optimizer.grad_scale = None
            for key, old in old_scalars.items():
                optimizer.state[key] = mx.where(ok, optimizer.state[key], old)
            return gnorm

        def finish(grads, loss):
            # A step whose loss or gradients are not finite is never applied: the update is
            # computed, then every weight and optimizer value is selected back to its old
            # value in the same graph (no extra copy held; the loop then stops or skips).
            if isinstance(optimizer, GuardedAdamW):
                return guarded_finish(grads, loss)
            if clip > 0:
                grads, gnorm = optim.clip_grad_norm(grads, clip)
            else:
                gnorm = mx.sqrt(sum(mx.sum(mx.square(g.astype(mx.float32))) for _, g in tree_flatten(grads)))
            ok = mx.isfinite(loss) & mx.isfinite(gnorm)
            old_state = tree_map(lambda v: v, optimizer.state)  # the same arrays, new containers
            old_params = model.trainable_parameters()
            optimizer.update(model, grads)
            model.update(tree_map(lambda new, old: mx.where(ok, new, old), model.trainable_parameters(),
                                  old_params))
            keep_if(ok, optimizer.state, old_state)
            return gnorm

        state = [model.state, optimizer.state, mx.random.state]

        @partial(mx.compile, inputs=state, outputs=state)
        def step(*args):
            out, grads = loss_and_grad(model, *args)
            v = value(out)
            return v, finish(grads, scalar(v))

        @partial(mx.compile, inputs=state, outputs=state)
        def micro(*args):
            out, grads = loss_and_grad(model, *args)
            return value(out), grads

        @partial(mx.compile, inputs=state, outputs=state)
        def apply(grads, out):
            return finish(grads, scalar(out))

        @partial(mx.compile, inputs=state)
        def eval_fn(*args):  # the objective's evaluation sums (objective.evaluate calls it)
            return objective.eval_value(model, *args)

        # one fused graph for the common case; micro + apply for accumulation and reducers
        self.fused_step, self.micro, self.apply, self.eval_fn = step, micro, apply, eval_fn
        self.state = state

    def _args(self, batch: Batch, norm: mx.array) -> tuple:
        return self.objective.args(batch, self.packed, norm)

    def _norm(self, batches: list[Batch]) -> mx.array:
        # normalised by the whole (global) step: with a reducer each process's gradient is its
        # share of the one-process mean, and their sum is that mean
        return self.objective.norm(batches)

    def __call__(self, batches: list) -> tuple[mx.array, mx.array]:
        """One optimizer step over `batches` (grad_accum micro-batches) -> (out, grad norm).

        SFT's loss is the mean over every trained token of all micro-batches (token-weighted);
        a preference loss is the mean over all pairs.
        """
        norm = self._norm(batches)
        if len(batches) == 1 and self.reducer is None:
            return self.fused_step(*self._args(batches[0], norm))
        total, grads = None, None
        for b in batches:
            part = self.reducer.shard(b) if self.reducer is not None else b
            loss, g = self.micro(*self._args(part, norm))
            total = loss if total is None else total + loss
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(total, grads)  # bound memory: one micro-batch graph at a time
        if self.reducer is not None:
            total, grads = self.reducer.reduce(total, grads, self.objective.extremes)
        return total, self.apply(grads, total)

    def evaluate(self, stream: BatchStream, n_batches: int) -> tuple[float, int, dict[str, float]]:
        """The objective's evaluation over the first `n_batches` validation batches (-1: all):
        (mean loss, the count it is a mean over, the eval event's other fields)."""
        return self.objective.evaluate(self, stream, n_batches)
