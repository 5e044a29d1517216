"""The training loop: LoRA, full fine-tuning and from-scratch training.

Two entry points:
- `run(cfg, resume=False, on_event=None, control=None, taps_hook=None)`: everything the CLI
  and the TUI need: validate, read the data, load or build the model, create (or reopen) the
  run directory, train, write the result. Bad input raises UserError before anything is
  written.
- `train(cfg, model, tokenizer, dataset, run, ...)`: the loop itself, for callers that built
  their own model and data.

The step is compiled (`mx.compile` with the model, optimizer and RNG state as inputs and
outputs, as mlx-lm's tuner does): forward, token-weighted cross-entropy, backward, gradient
clipping and the AdamW update are one graph. Everything observable is an event
(mlxtoy.events) handed to `on_event` and appended to the run's metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from mlxtoy import backend
from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.events import (CheckpointEvent, DoneEvent, EvalEvent, Event, LogEvent, SampleEvent,
                           StartEvent, StepEvent)
from mlxtoy.models.llama import block_causal_mask
from mlxtoy.train.checkpoint import (CheckpointState, RunDir, flat_optimizer_state, load_checkpoint,
                                     restore_optimizer_state, write_final)
from mlxtoy.train import distributed
from mlxtoy.train.data import BatchStream, Dataset, Renderer, load_dataset, read_data

# A taps hook gets (model, step) and returns an event (or events, or None) to emit.
TapsHook = Callable[[nn.Module, int], "Event | list[Event] | None"]


# ---------------------------------------------------------------------------------------------
# Control: what a front end (TUI, signal handler) can ask of a running loop
# ---------------------------------------------------------------------------------------------


class TrainControl:
    """Thread-safe requests, checked by the loop between steps."""

    def __init__(self, stop_at: int | None = None):
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self._stop_reason: str | None = None
        self._requests: set[str] = set()
        self.stop_at = stop_at  # stop (with a checkpoint) once this step is done

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def stop(self, reason: str = "stopped") -> None:
        with self._lock:
            self._stop_reason = self._stop_reason or reason
        self._running.set()  # a paused loop must wake up to stop

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def request_sample(self) -> None:
        self._request("sample")

    def request_checkpoint(self) -> None:
        self._request("checkpoint")

    def request_eval(self) -> None:
        self._request("eval")

    def _request(self, what: str) -> None:
        with self._lock:
            self._requests.add(what)

    def take(self, what: str) -> bool:
        """True (once) if `what` was requested since the last call."""
        with self._lock:
            if what in self._requests:
                self._requests.discard(what)
                return True
            return False

    def wait_while_paused(self) -> None:
        while not self._running.wait(timeout=0.2):
            pass


@dataclass
class TrainResult:
    run_dir: str
    step: int
    reason: str  # finished | stopped | interrupted | nan
    final_path: str | None = None
    last_checkpoint: str | None = None
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    message: str = ""


# ---------------------------------------------------------------------------------------------
# Models for each method
# ---------------------------------------------------------------------------------------------


def init_scratch(model: nn.Module, seed: int, init_scale: float = 1.0) -> nn.Module:
    """The seed's initialisation: norms 1, biases 0, matmul weights N(0, init_scale/sqrt(fan_in)),
    embeddings N(0, 0.02); one key per parameter (sorted names), so the result depends only on
    the seed and the shapes."""
    key = mx.random.key(seed)
    new = {}
    for i, (name, p) in enumerate(sorted(tree_flatten(model.parameters()))):
        k = mx.random.fold_in(key, i) if hasattr(mx.random, "fold_in") else mx.random.split(key, i + 2)[i + 1]
        if name.endswith("norm.weight"):
            v = mx.ones(p.shape)
        elif name.endswith(".bias"):
            v = mx.zeros(p.shape)
        elif name.startswith(("tok_embeddings", "pos_embeddings")):
            v = 0.02 * mx.random.normal(p.shape, key=k)
        else:
            fan_in = p.shape[-1]  # (out, in) and per-head (H, Dh, in)
            v = (init_scale / math.sqrt(fan_in)) * mx.random.normal(p.shape, key=k)
        new[name] = v.astype(p.dtype)
    model.load_weights(list(new.items()))
    mx.eval(model.parameters())
    return model


def set_trainable(model: nn.Module, cfg: TrainConfig) -> None:
    """full: every block weight, plus the opt-in embeddings / final norm / output."""
    if cfg.method == "scratch":
        model.unfreeze()
        return
    model.freeze()
    for layer in model.layers:
        layer.unfreeze()
    if cfg.train_embeddings:
        model.tok_embeddings.unfreeze()
    if cfg.train_norm:
        model.norm.unfreeze()
    if cfg.train_output:
        if "output" in model:
            model.output.unfreeze()
        else:  # tied: the output is the embedding table
            model.tok_embeddings.unfreeze()


def enable_grad_checkpoint(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass (memory for compute).

    Each block's class is swapped for a subclass whose call goes through `mx.checkpoint`;
    parameter names do not change, and other models are untouched.
    """
    for layer in model.layers:
        base_cls = type(layer)
        if getattr(base_cls, "_checkpointed", False):
            continue

        def checkpointed_call(self, x, mask=None, cache=None, taps=None, _base=base_cls):
            if cache is not None or taps is not None or isinstance(mask, str):
                return _base.__call__(self, x, mask, cache, taps)

            def inner(params, x, *mask_arg):
                self.update(params)
                return _base.__call__(self, x, mask_arg[0] if mask_arg else None)

            args = (x,) if mask is None else (x, mask)
            return mx.checkpoint(inner)(self.trainable_parameters(), *args)

        layer.__class__ = type(f"Checkpointed{base_cls.__name__}", (base_cls,),
                               {"__call__": checkpointed_call, "_checkpointed": True})


def _train_dtype(cfg: TrainConfig) -> mx.Dtype:
    return backend.compute_dtype() if cfg.dtype == "auto" else getattr(mx, cfg.dtype)


def build_model(cfg: TrainConfig) -> tuple[nn.Module, Any, dict[str, Any]]:
    """-> (model ready to train, tokenizer, resolved facts for config.yaml)."""
    from mlxtoy.io.registry import resolve_model
    from mlxtoy.loading import build_model as _build, load_weights
    from mlxtoy.models.lora import apply_lora, lora_config_dict, quantize_base
    from mlxtoy.train.checkpoint import load_tokenizer

    mx.random.seed(cfg.seed)
    resolved: dict[str, Any] = {"mlxtoy_version": _version(), "backend": backend.INFO.describe()}
    if cfg.method == "scratch":
        from mlxtoy.models.tiny import CHAR_TOKENIZERS, char_tokenizer_for

        source = cfg.tokenizer or ("char" if cfg.arch == "tiny" else cfg.model)
        if source in CHAR_TOKENIZERS:  # character / byte vocabulary (the reference LM's)
            tokenizer = char_tokenizer_for(source, cfg.data)
            resolved["char_tokenizer"] = tokenizer.to_dict()
        else:
            tokenizer = load_tokenizer(source)
            resolved["tokenizer_path"] = resolve_model(source)[1]
        mcfg = cfg.model_config(tokenizer.vocab_size)
        model = init_scratch(_build(mcfg), cfg.seed, cfg.init_scale)
        if cfg.lens:  # projection lens: frozen donor table, trainable W_proj (models.lens)
            from mlxtoy.models.lens import attach_lens

            resolved["lens"] = attach_lens(model, cfg.lens, tokenizer, seed=cfg.seed)
    else:
        dtype = _train_dtype(cfg)
        # trainable weights stay float32 (master copies); a LoRA base may be lower precision
        load_dtype = dtype if cfg.method == "lora" else mx.float32
        mcfg, weights, meta, tokenizer = load_weights(cfg.model, load_dtype)
        model = _build(mcfg, weights)
        model.meta = meta
        del weights
        resolved["model_path"] = meta.source
        quantized = any(t.startswith(("Q", "IQ")) for t in meta.tensor_types.values())
        if cfg.method == "lora":
            apply_lora(model, cfg.lora_targets, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout,
                       cfg.lora_per_head_q, cfg.lora_layers)
            resolved["lora"] = lora_config_dict(cfg.lora_targets, cfg.lora_rank, cfg.lora_alpha,
                                                cfg.lora_dropout, cfg.lora_per_head_q,
                                                cfg.lora_layers, mcfg.n_layers)
            # QLoRA: MLX multiplies quantized weights fast on Metal/CUDA, not on CPU (there the
            # loader already dequantized the base once to float32).
            if cfg.qlora == "on" or (cfg.qlora == "auto" and quantized and backend.INFO.device != "cpu"):
                quantize_base(model)
                resolved["qlora"] = True
        else:
            set_trainable(model, cfg)
    if cfg.method != "lora" and _train_dtype(cfg) != mx.float32:
        # mixed precision: trainable weights stay float32 (master copies, cast per step in the
        # loss); frozen ones are simply stored in the compute dtype
        frozen = {k: v for k, v in tree_flatten(model.parameters())}
        for k, _ in tree_flatten(model.trainable_parameters()):
            frozen.pop(k, None)
        model.load_weights([(k, v.astype(_train_dtype(cfg))) for k, v in frozen.items()], strict=False)
        resolved["mixed_precision"] = str(_train_dtype(cfg)).replace("mlx.core.", "")
    resolved["model_config"] = mcfg.to_dict()
    if cfg.grad_checkpoint:
        enable_grad_checkpoint(model)
    mx.eval(model.parameters())
    return model, tokenizer, resolved


def _version() -> str:
    import mlxtoy

    return mlxtoy.__version__


# ---------------------------------------------------------------------------------------------
# Optimizer, loss, compiled step
# ---------------------------------------------------------------------------------------------


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


def _batch_arrays(batch, packed: bool) -> tuple[mx.array, ...]:
    # Rows holding one document each (padding only at the end) need no block mask: the plain
    # causal mask gives the same losses, and the fused kernel skips a (B, H, T, T) select.
    segs = mx.array(batch.segments) if packed and batch.segments.max() > 0 else None
    return mx.array(batch.inputs), mx.array(batch.targets), mx.array(batch.weights), segs


class Stepper:
    """The compiled training step (and evaluation), built once per model and optimizer."""

    def __init__(self, model: nn.Module, optimizer: optim.Optimizer, cfg: TrainConfig, packed: bool):
        self.model, self.optimizer, self.cfg, self.packed = model, optimizer, cfg, packed
        clip = cfg.grad_clip

        # Mixed precision for full / scratch (LoRA: the frozen base is already stored in the
        # compute dtype): compute with a low-precision copy of the float32 master weights.
        low = _train_dtype(cfg)
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

        def finish(grads):
            if clip > 0:
                grads, gnorm = optim.clip_grad_norm(grads, clip)
            else:  # no clipping: skip the norm too (a pass over every gradient; not free on CPU)
                gnorm = mx.array(float("nan"))
            optimizer.update(model, grads)
            return gnorm

        state = [model.state, optimizer.state, mx.random.state]

        @partial(mx.compile, inputs=state, outputs=state)
        def step(inputs, targets, weights, segments, norm):
            loss, grads = loss_and_grad(model, inputs, targets, weights, segments, norm)
            return loss, finish(grads)

        @partial(mx.compile, inputs=state, outputs=state)
        def micro(inputs, targets, weights, segments, norm):
            return loss_and_grad(model, inputs, targets, weights, segments, norm)

        @partial(mx.compile, inputs=state, outputs=state)
        def apply(grads):
            return finish(grads)

        @partial(mx.compile, inputs=state)
        def eval_sum(inputs, targets, weights, segments):
            ce = token_losses(model, inputs, targets, segments, train=False)
            return (ce * weights).sum()

        self._step, self._micro, self._apply, self._eval = step, micro, apply, eval_sum
        self.state = state

    def __call__(self, batches: list) -> tuple[mx.array, mx.array]:
        """One optimizer step over `batches` (grad_accum micro-batches) -> (loss, grad norm).

        The loss is the mean over every trained token of all micro-batches (token-weighted).
        """
        norm = mx.array(max(1, sum(b.n_loss for b in batches)), dtype=mx.float32)
        if len(batches) == 1:
            inputs, targets, weights, segs = _batch_arrays(batches[0], self.packed)
            return self._step(inputs, targets, weights, segs, norm)
        total, grads = None, None
        for b in batches:
            inputs, targets, weights, segs = _batch_arrays(b, self.packed)
            loss, g = self._micro(inputs, targets, weights, segs, norm)
            total = loss if total is None else total + loss
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(total, grads)  # bound memory: one micro-batch graph at a time
        return total, self._apply(grads)

    def evaluate(self, stream: BatchStream, n_batches: int) -> tuple[float, int]:
        """Mean token loss over the first `n_batches` validation batches (-1: all)."""
        total, count = 0.0, 0
        for b in stream.epoch_batches(n_batches):
            inputs, targets, weights, segs = _batch_arrays(b, self.packed)
            total += self._eval(inputs, targets, weights, segs).item()
            count += b.n_loss
        return (total / count if count else float("nan")), count


# ---------------------------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------------------------


def greedy_text(model, tokenizer, prompt_ids: list[int], max_tokens: int) -> str:
    """Greedy continuation of prompt_ids, stopping at EOS (mlxtoy.generate when present)."""
    try:
        from mlxtoy.generate import generate
    except ImportError:  # a minimal fallback: no cache, argmax
        generate = None
    if generate is not None:
        return generate(model, tokenizer, list(prompt_ids), max_tokens=max_tokens, temp=0.0)
    ids = list(prompt_ids)
    eos = set(getattr(tokenizer, "eos_ids", None) or ())
    out: list[int] = []
    for _ in range(max_tokens):
        nxt = int(mx.argmax(model(mx.array([ids]))[0, -1]).item())
        if nxt in eos:
            break
        ids.append(nxt)
        out.append(nxt)
    return tokenizer.decode(out)


@contextlib.contextmanager
def preserved_rng():
    """Hooks, samples and evaluation must not move the training RNG (exact resume)."""
    hi, lo = (int(v) for v in mx.random.state[0].tolist())
    try:
        yield
    finally:
        mx.random.seed((hi << 32) | lo)


def _rng_key() -> list[int]:
    return [int(v) for v in mx.random.state[0].tolist()]


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def _count(params) -> int:
    return sum(v.size for _, v in tree_flatten(params))


def train(cfg: TrainConfig, model: nn.Module, tokenizer, dataset: Dataset, run: RunDir, *,
          resolved: dict[str, Any] | None = None, resume_from: str | None = None,
          on_event: Callable[[Event], None] | None = None, control: TrainControl | None = None,
          taps_hook: TapsHook | None = None, handle_sigint: bool = True) -> TrainResult:
    """Train `model` on `dataset` up to cfg.steps, writing into `run` (which must exist).

    resume_from: a checkpoint folder to continue from (weights, optimizer, RNG, data position).
    on_event: called with every event (also appended to metrics.jsonl).
    control: pause / resume / stop / request sample, eval or checkpoint from another thread.
    taps_hook: called as taps_hook(model, step) every cfg.taps_every steps; returns events.
    handle_sigint: in the main thread, the first Ctrl-C stops after the current step with a
    checkpoint; a second one raises KeyboardInterrupt.
    """
    control = control or TrainControl()
    resolved = resolved or {}
    packed = cfg.pack
    pad_id = getattr(tokenizer, "pad_id", None)
    pad_id = pad_id if pad_id is not None else (getattr(tokenizer, "eos_id", None) or 0)
    train_stream = BatchStream(dataset.train, cfg.batch_size, cfg.seq_len, cfg.seed, packed, True, pad_id)
    valid_stream = (BatchStream(dataset.valid, cfg.batch_size, cfg.seq_len, cfg.seed, packed, False, pad_id)
                    if dataset.valid else None)

    optimizer = make_optimizer(cfg)
    optimizer.init(model.trainable_parameters())
    step, position, elapsed_before, tokens_seen = 0, 0, 0.0, 0
    if resume_from is not None:
        st, trainable, opt_state = load_checkpoint(resume_from)
        model.load_weights(list(trainable.items()), strict=False)
        restore_optimizer_state(optimizer, opt_state, resume_from)
        mx.random.seed((st.rng[0] << 32) | st.rng[1])
        step, position, elapsed_before, tokens_seen = st.step, st.data_position, st.elapsed, st.tokens_seen
        run.truncate_metrics(step)
    dist = distributed.active()  # data-parallel ranks (mlxtoy.train.distributed); None: one process
    if dist is not None:  # every rank starts from rank 0's state (its checkpoint on resume)
        step, position, elapsed_before, tokens_seen = dist.sync_start(
            model, optimizer, resume_from is not None, (step, position, elapsed_before, tokens_seen))
    model.train()
    mx.eval(model.parameters(), optimizer.state)
    stepper = Stepper(model, optimizer, cfg, packed)
    clip_off = cfg.grad_clip <= 0
    if dist is not None:  # shard each global batch, all-reduce gradients, agree on stop/requests
        stepper, control = dist.wrap(stepper, control, run)

    losses: list[float] = []
    last_ckpt = run.latest_checkpoint()
    last_val: float | None = None
    last_saved_step = step if resume_from is not None else -1

    def emit(ev: Event) -> None:
        run.append_event(ev.to_json())
        if on_event is not None:
            on_event(ev)

    def log(msg: str, level: str = "info") -> None:
        emit(LogEvent(message=msg, level=level))

    def save(at_step: int) -> None:
        nonlocal last_ckpt, last_saved_step
        state = CheckpointState(step=at_step, data_position=position, rng=_rng_key(),
                                elapsed=elapsed_before + (time.perf_counter() - t_start),
                                tokens_seen=tokens_seen)
        trainable = dict(tree_flatten(model.trainable_parameters()))
        last_ckpt = run.save_checkpoint(state, trainable, flat_optimizer_state(optimizer), cfg.keep_checkpoints)
        last_saved_step = at_step
        emit(CheckpointEvent(step=at_step, path=last_ckpt))

    def evaluate(at_step: int) -> None:
        nonlocal last_val
        if valid_stream is None:
            return
        model.eval()
        with preserved_rng():
            val, n = stepper.evaluate(valid_stream, cfg.eval_batches)
        model.train()
        last_val = val
        emit(EvalEvent(step=at_step, val_loss=val, val_ppl=math.exp(min(val, 50.0)), val_tokens=n))

    prompts = _sample_prompts(cfg, tokenizer, dataset)

    def sample(at_step: int) -> None:
        model.eval()
        with preserved_rng():
            for text, ids in prompts:
                out = greedy_text(model, tokenizer, ids, cfg.sample_tokens)
                emit(SampleEvent(step=at_step, prompt=text, text=out))
        model.train()

    emit(StartEvent(run_dir=run.path, method=cfg.method, total_steps=cfg.steps, start_step=step,
                    trainable_params=_count(model.trainable_parameters()),
                    total_params=_count(model.parameters()), config=cfg.to_dict()))
    log(f"data: train {dataset.train_stats.describe()}; valid {len(dataset.valid)} examples; "
        f"{train_stream.batches_per_epoch} batches per epoch" + ("" if packed else " (padded)"))
    if resume_from is not None:
        log(f"resumed from {resume_from} at step {step}")
    if valid_stream is None:
        log("no validation examples: evaluation is skipped", "warning")

    reason = "finished"
    t_start = time.perf_counter()
    window: list[float] = []
    in_update = False
    old_handler = None
    if handle_sigint and threading.current_thread() is threading.main_thread():
        def on_sigint(signum, frame):
            if control.stop_reason == "interrupted":
                raise KeyboardInterrupt
            control.stop("interrupted")

        old_handler = signal.signal(signal.SIGINT, on_sigint)
    try:
        if step == 0 and cfg.eval_every > 0:
            evaluate(0)
        while step < cfg.steps:
            control.wait_while_paused()
            if control.stop_reason:
                reason = control.stop_reason
                break
            t0 = time.perf_counter()
            batches = [train_stream.batch(position + k) for k in range(cfg.grad_accum)]
            in_update = True
            loss, gnorm = stepper(batches)
            mx.eval(stepper.state, loss, gnorm)
            step += 1
            position += cfg.grad_accum
            in_update = False
            loss_v = loss.item()
            dt = time.perf_counter() - t0
            n_tokens = sum(b.n_tokens for b in batches)
            tokens_seen += n_tokens
            if not math.isfinite(loss_v):
                reason = "nan"
                log(f"loss is {loss_v} at step {step}: stopping; the last good checkpoint is "
                    f"{last_ckpt or 'none'} (try a lower --lr or --grad-clip)", "error")
                break
            losses.append(loss_v)
            window = (window + [dt])[-20:]
            lr = float(optimizer.learning_rate.item()) if isinstance(optimizer.learning_rate, mx.array) else float(optimizer.learning_rate)
            emit(StepEvent(step=step, loss=loss_v, lr=lr, tokens=sum(b.n_loss for b in batches),
                           tokens_per_sec=n_tokens / dt if dt > 0 else 0.0,
                           elapsed=elapsed_before + time.perf_counter() - t_start,
                           eta=(cfg.steps - step) * (sum(window) / len(window)),
                           peak_memory_gb=mx.get_peak_memory() / 1e9, grad_norm=None if clip_off else gnorm.item()))
            last = step == cfg.steps
            if (cfg.eval_every and step % cfg.eval_every == 0) or control.take("eval") or (last and cfg.eval_every >= 0):
                evaluate(step)
            if (cfg.sample_every and step % cfg.sample_every == 0) or control.take("sample"):
                sample(step)
            if taps_hook is not None and cfg.taps_every and step % cfg.taps_every == 0:
                with preserved_rng():
                    out = taps_hook(model, step)
                for ev in (out if isinstance(out, list) else [out] if out is not None else []):
                    emit(ev)
            if (cfg.save_every and step % cfg.save_every == 0) or control.take("checkpoint"):
                save(step)
            if control.stop_at is not None and step >= control.stop_at and step < cfg.steps:
                reason = "stopped"
                break
    except KeyboardInterrupt:
        reason = "interrupted"
        if in_update:  # the model may be half-way through an update: keep the last checkpoint
            in_update = None
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)

    final_path = None
    if reason != "nan" and in_update is not None and last_saved_step != step and step > 0:
        save(step)
    if reason == "finished":
        final_path = (write_final(run, cfg, model, tokenizer, resolved, step)
                      if not getattr(run, "read_only", False) else None)  # ranks > 0 write nothing
    msg = {"finished": f"finished {step} steps; result in {final_path}",
           "stopped": f"stopped at step {step}; checkpoint {last_ckpt}",
           "interrupted": f"interrupted at step {step}; checkpoint {last_ckpt}; continue with "
                          f"--resume {run.path}",
           "nan": f"loss became non-finite at step {step}; the last good checkpoint is "
                  f"{last_ckpt or 'none (no checkpoint was written)'}"}[reason]
    emit(DoneEvent(step=step, reason=reason, final_path=final_path))
    return TrainResult(run.path, step, reason, final_path, last_ckpt, losses, last_val, msg)


def _sample_prompts(cfg: TrainConfig, tokenizer, dataset: Dataset) -> list[tuple[str, list[int]]]:
    r = Renderer(tokenizer, cfg.mask_prompt)
    out = []
    for text in cfg.sample_prompts:
        ids = (r._render([{"role": "user", "content": text}], True, "sample_prompts")
               if r.has_template else tokenizer.encode(text))
        out.append((text, ids))
    if not out:
        for rec in dataset.valid_records[:2]:
            try:
                ids, _ = r.prompt_of(rec)
            except UserError:
                continue
            shown = rec.value if isinstance(rec.value, str) else (
                rec.value[0] if rec.kind == "completion" else
                next((m["content"] for m in reversed(rec.value) if m["role"] == "user"), ""))
            out.append((shown[:200], ids))
    return out


# ---------------------------------------------------------------------------------------------
# Everything, for the CLI and the TUI
# ---------------------------------------------------------------------------------------------

# fields that change the shape of what a checkpoint holds; a resume may not change them
_STRUCTURAL = ("method", "arch", "lens", "model", "tokenizer", "lora_rank", "lora_targets", "lora_per_head_q",
               "lora_layers", "train_embeddings", "train_norm", "train_output", "d_model",
               "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff", "tie_embeddings")


def resume_config(run_path: str, overrides: dict[str, Any]) -> TrainConfig:
    """The config of an existing run with `overrides` applied (structural changes refused)."""
    run = RunDir(run_path)
    if not run.is_run():
        raise UserError(f"{run_path}: not a training run (nothing to resume)")
    cfg, _ = run.read_config()
    for k, v in overrides.items():
        if k == "out":
            if v and RunDir(v).path != run.path:
                raise UserError(f"--resume continues the run in place; --out {v} differs from {run_path}")
            continue
        if k in _STRUCTURAL and v != getattr(cfg, k):
            raise UserError(f"cannot change {k} when resuming ({getattr(cfg, k)!r} -> {v!r})")
        setattr(cfg, k, v)
    cfg.out = run.path
    cfg.__post_init__()
    return cfg


@dataclass
class Prepared:
    cfg: TrainConfig
    run: RunDir
    model: nn.Module
    tokenizer: Any
    dataset: Dataset
    resolved: dict[str, Any]
    resume_from: str | None


def prepare(cfg: TrainConfig, resume: bool = False) -> Prepared:
    """Validate, read data, build the model; create the run directory only when all is well."""
    cfg.validate()
    run = RunDir(cfg.out)
    resume_from = None
    if resume:
        run.clean_partial()
        resume_from = run.latest_checkpoint()
        if resume_from is None:
            raise UserError(f"{run.path}: no complete checkpoint to resume from")
    else:
        run.check_fresh()
    raw = read_data(cfg.data)  # format errors (file:line) before the model is loaded
    model, tokenizer, resolved = build_model(cfg)
    dataset = load_dataset(cfg.data, tokenizer, cfg.seq_len, cfg.mask_prompt, cfg.valid_fraction,
                           cfg.seed, raw=raw)
    resolved["data"] = {"train_examples": len(dataset.train), "valid_examples": len(dataset.valid),
                        "test_examples": len(dataset.test), "truncated": dataset.train_stats.truncated}
    if resume:
        _, old = run.read_config()
        resolved = {**old, **{k: v for k, v in resolved.items() if k not in ("lora", "model_config")}}
    run.create(cfg, resolved)
    return Prepared(cfg, run, model, tokenizer, dataset, resolved, resume_from)


def run(cfg: TrainConfig, resume: bool = False, on_event: Callable[[Event], None] | None = None,
        control: TrainControl | None = None, taps_hook: TapsHook | None = None,
        handle_sigint: bool = True) -> TrainResult:
    """Prepare and train (see `prepare` and `train`)."""
    p = prepare(cfg, resume)
    return train(p.cfg, p.model, p.tokenizer, p.dataset, p.run, resolved=p.resolved,
                 resume_from=p.resume_from, on_event=on_event, control=control,
                 taps_hook=taps_hook, handle_sigint=handle_sigint)
