"""The training loop, top to bottom: data streams, optimizer, resume, then step after step
with evaluation, samples, taps and checkpoints between them.

Everything observable is an event (mlxtoy.events) handed to one sink (the job fans it out to
metrics.jsonl, the progress view or the protocol stream). What a front end asks for arrives
through a `Control`; data-parallel training plugs in as a `Parallel` (its starting point and
its gradient `Reducer`), so this loop is the same for one process and for many.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.events import (CheckpointEvent, MetricsSink, Command, DoneEvent, EvalEvent, Event, LogEvent,
                           SampleEvent, StartEvent, StepEvent)
from mlxtoy.generate import generate
from mlxtoy.loading import load_partial
from mlxtoy.rundir import CheckpointState, RunDir, RunFacts
from mlxtoy.models.quant import parameter_count
from mlxtoy.train.checkpoint import (flat_optimizer_state, load_checkpoint, load_objective_state,
                                     restore_optimizer_state, save_best, save_checkpoint, write_final)
from mlxtoy.train.control import Control, TrainControl
from mlxtoy.train.data import Dataset
from mlxtoy.train.formats import Renderer
from mlxtoy.train.objectives import Objective, Setup, make_objective
from mlxtoy.train.step import Reducer, Stepper, make_optimizer

# A taps hook gets (model, step) and returns an event (or events, or None) to emit.
TapsHook = Callable[[nn.Module, int], "Event | list[Event] | None"]
MAX_SKIPPED = 10  # --nonfinite skip: a run this many non-finite steps in a row stops anyway
Counters = tuple[int, int, float, int]  # step, data position, elapsed seconds, tokens seen


class Parallel(Protocol):
    """Data-parallel training as the loop sees it (mlxtoy.train.distributed implements it)."""

    is_main: bool

    def broadcast(self, arrays: dict[str, mx.array], what: str) -> dict[str, mx.array]: ...

    def sync_start(self, model: nn.Module, optimizer: Any, resumed: bool, counters: Counters) -> Counters: ...

    def attach(self, control: Control, run: RunDir) -> tuple[Reducer, Control]: ...


@dataclass
class TrainResult:
    run_dir: str
    step: int
    reason: str  # finished | early_stopped | stopped | interrupted | nan
    final_path: str | None = None
    last_checkpoint: str | None = None
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    message: str = ""


def greedy_text(model, tokenizer, prompt_ids: list[int], max_tokens: int) -> str:
    """Greedy continuation of prompt_ids, stopping at EOS."""
    return generate(model, tokenizer, list(prompt_ids), max_tokens=max_tokens, temp=0.0)


@contextlib.contextmanager
def preserved_rng():
    """Hooks, samples and evaluation must not move the training RNG (exact resume)."""
    hi, lo = (int(v) for v in mx.random.state[0].tolist())
    try:
        yield
    finally:
        mx.random.seed((hi << 32) | lo)


def rng_key() -> list[int]:
    return [int(v) for v in mx.random.state[0].tolist()]


def epoch_steps(cfg: TrainConfig, dataset: Dataset, objective: Objective) -> int:
    """The optimizer steps of cfg.epochs passes over the training data: the training stream's
    batches per epoch (packed rows or padded examples; pairs, prompts for other objectives)
    over the micro-batches per step, rounded up so that the last epoch is complete."""
    stream = objective.stream(dataset.train, True, 0)
    return max(1, math.ceil(cfg.epochs * stream.batches_per_epoch / cfg.grad_accum))


@dataclass
class EarlyStop:
    """The lowest validation loss (what best/ holds) and --early-stop's patience count."""

    best_val: float | None = None
    best_step: int | None = None
    patience_best: float | None = None  # the last loss that improved by at least the delta
    bad_evals: int = 0

    def update(self, step: int, val: float, delta: float) -> bool:
        """Count evaluation `val` at `step`; True when it is a new minimum (best/ is due)."""
        if not math.isfinite(val):
            self.bad_evals += 1
            return False
        if self.patience_best is None or val < self.patience_best - delta:
            self.patience_best, self.bad_evals = val, 0
        else:
            self.bad_evals += 1
        if self.best_val is None or val < self.best_val:
            self.best_val, self.best_step = val, step
            return True
        return False

    def fields(self) -> dict[str, Any]:
        return {"best_val": self.best_val, "best_step": self.best_step,
                "patience_best": self.patience_best, "bad_evals": self.bad_evals}


def _count(params) -> int:
    return sum(v.size for _, v in tree_flatten(params))


def train(cfg: TrainConfig, model: nn.Module, tokenizer, dataset: Dataset, run: RunDir, *,
          facts: RunFacts | None = None, resume_from: str | None = None,
          emit: Callable[[Event], None] | None = None, control: Control | None = None,
          taps_hook: TapsHook | None = None, handle_sigint: bool = True,
          parallel: Parallel | None = None, objective: Objective | None = None) -> TrainResult:
    """Train `model` on `dataset` up to cfg.steps, writing into `run` (which must exist).

    resume_from: a checkpoint folder to continue from (weights, optimizer, RNG, data position).
    emit: called with every event (default: append it to the run's metrics.jsonl; the job
    fans it out to metrics.jsonl, the progress view or the protocol stream).
    control: pause / resume / stop / request sample, eval or checkpoint from another thread.
    parallel: data-parallel ranks (every rank runs this loop; see mlxtoy.train.distributed).
    taps_hook: called as taps_hook(model, step) every cfg.taps_every steps; returns events.
    objective: the run's (the job builds it once); built from cfg when not given.
    handle_sigint: in the main thread, Ctrl-C stops the run at once, whatever it is doing
    (sampling, scoring, evaluating), with a checkpoint of the last finished step; during an
    optimizer update it stops right after it (a second Ctrl-C: at once, keeping the last
    checkpoint). With data-parallel ranks, and for SIGTERM, the run stops after the current step.
    """
    control = control or TrainControl()
    facts = facts or RunFacts()
    emit = emit or MetricsSink(run)
    packed = cfg.pack
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
    objective = objective or make_objective(cfg)  # its batches, loss, metrics (mlxtoy.train.objectives)
    train_stream = objective.stream(dataset.train, True, pad_id)
    valid_stream = objective.stream(dataset.valid, False, pad_id) if dataset.valid else None
    objective.starting_point(model)

    optimizer = make_optimizer(cfg)
    optimizer.init(model.trainable_parameters())
    step, position, elapsed_before, tokens_seen = 0, 0, 0.0, 0
    stopper = EarlyStop()
    if resume_from is not None:
        st, trainable, opt_state = load_checkpoint(resume_from)
        stopper = EarlyStop(st.best_val, st.best_step, st.patience_best, st.bad_evals)
        load_partial(model, trainable, resume_from)
        restore_optimizer_state(optimizer, opt_state, resume_from)
        mx.random.seed((st.rng[0] << 32) | st.rng[1])
        step, position, elapsed_before, tokens_seen = st.step, st.data_position, st.elapsed, st.tokens_seen
        objective.load_state(load_objective_state(resume_from))
        run.truncate_metrics(step)
    reducer = None
    if parallel is not None:  # every rank starts from rank 0's state (its checkpoint on resume)
        step, position, elapsed_before, tokens_seen = parallel.sync_start(
            model, optimizer, resume_from is not None, (step, position, elapsed_before, tokens_seen))
        # shard each global batch, all-reduce gradients, agree on stop and requests
        reducer, control = parallel.attach(control, run)
    model.train()
    mx.eval(model.parameters(), optimizer.state)
    stepper = Stepper(model, optimizer, cfg, packed, reducer, objective)

    losses: list[float] = []
    last_ckpt = run.latest_checkpoint()
    last_val: float | None = None
    last_saved_step = step if resume_from is not None else -1

    def log(msg: str, level: str = "info") -> None:
        emit(LogEvent(message=msg, level=level))

    def state_now(at_step: int, **extra: Any) -> CheckpointState:
        return CheckpointState(step=at_step, data_position=position, rng=rng_key(),
                               elapsed=elapsed_before + (time.perf_counter() - t_start),
                               tokens_seen=tokens_seen, **stopper.fields(), **extra)

    def save(at_step: int) -> None:
        nonlocal last_ckpt, last_saved_step
        trainable = dict(tree_flatten(model.trainable_parameters()))
        last_ckpt = save_checkpoint(run, state_now(at_step), trainable, flat_optimizer_state(optimizer),
                                    cfg.keep_checkpoints, objective.state())
        last_saved_step = at_step
        emit(CheckpointEvent(step=at_step, path=last_ckpt))

    def evaluate(at_step: int) -> None:
        nonlocal last_val
        if valid_stream is None:
            return
        model.eval()
        with preserved_rng():
            val, n, pref = stepper.evaluate(valid_stream, cfg.eval_batches)
        model.train()
        last_val = val
        emit(EvalEvent.of(pref, step=at_step, val_loss=val, val_ppl=math.exp(min(val, 50.0)), val_tokens=n))
        if stopper.update(at_step, val, cfg.early_stop_delta):
            save_best(run, state_now(at_step, val_loss=val), dict(tree_flatten(model.trainable_parameters())))

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
                    total_params=parameter_count(model), config=cfg.to_dict(), shows=objective.shows()))
    log(f"data: train {dataset.train_stats.describe()}; valid {len(dataset.valid)} examples; "
        f"{train_stream.batches_per_epoch} batches per epoch" + ("" if packed else " (padded)"))
    if resume_from is not None:
        log(f"resumed from {resume_from} at step {step}")
    if valid_stream is None:
        log("no validation examples: evaluation is skipped", "warning")
    for warning in objective.data_warnings(dataset):
        log(warning, "warning")
    objective.prepare(Setup(model, tokenizer, stepper, dataset, run, resume_from, parallel, pad_id, log,
                            preserved_rng, train_stream, valid_stream))

    reason = "finished"
    t_start = time.perf_counter()
    window: list[float] = []
    skipped = 0  # non-finite steps in a row (--nonfinite skip)
    in_update = False
    old_handlers = {}
    if handle_sigint and threading.current_thread() is threading.main_thread():
        # Ctrl-C raises at once, unless an update is half-way (the model would be half-updated):
        # then it stops after it. SIGTERM (a scheduler, `kill`), and data-parallel ranks (which
        # must agree on the step), stop after the current step; a second Ctrl-C raises at once.
        def on_signal(signum, frame):
            if signum == signal.SIGINT and (control.stop_reason == "interrupted"
                                            or (not in_update and parallel is None)):
                raise KeyboardInterrupt
            control.stop("interrupted")

        old_handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if step == 0 and cfg.eval_every > 0:
            evaluate(0)
        while step < cfg.steps:
            control.wait_while_paused(step)
            if control.stop_reason:
                reason = control.stop_reason
                break
            t0 = time.perf_counter()
            try:
                data = objective.step_data(train_stream, position)  # GRPO: sampled and scored here
            except UserError:  # bad input found mid-run (a reward function that raises): keep the run
                if step > 0 and last_saved_step != step:
                    save(step)
                raise
            batches = data.batches
            in_update = True
            loss, gnorm = stepper(batches)
            mx.eval(stepper.state, loss, gnorm)
            step += 1
            position += data.positions
            in_update = False
            loss_v, fields = objective.step_fields(loss.tolist())
            gnorm_v = gnorm.item()
            dt = time.perf_counter() - t0
            n_tokens = sum(b.n_tokens for b in batches)
            tokens_seen += n_tokens
            if not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):  # the step was not applied
                skipped += 1
                what = f"loss {loss_v}, gradient norm {gnorm_v}"
                if cfg.nonfinite == "skip" and skipped <= MAX_SKIPPED:
                    log(f"step {step} skipped ({what}); its update was not applied", "warning")
                    continue
                reason = "nan"
                log(f"{what} at step {step}: stopping without applying it; the last good "
                    f"checkpoint is {last_ckpt or 'none'} (try a lower --lr or --grad-clip)", "error")
                break
            skipped = 0
            losses.append(loss_v)
            window = (window + [dt])[-20:]
            lr = float(optimizer.learning_rate.item()) if isinstance(optimizer.learning_rate, mx.array) else float(optimizer.learning_rate)
            emit(StepEvent.of(fields, step=step, loss=loss_v, lr=lr, tokens=sum(b.n_loss for b in batches),
                              tokens_per_sec=n_tokens / dt if dt > 0 else 0.0,
                              elapsed=elapsed_before + time.perf_counter() - t_start,
                              eta=(cfg.steps - step) * (sum(window) / len(window)),
                              peak_memory_gb=mx.get_peak_memory() / 1e9, grad_norm=gnorm_v))
            last = step == cfg.steps
            if (cfg.eval_every and step % cfg.eval_every == 0) or control.take(Command.EVAL) or (last and cfg.eval_every >= 0):
                evaluate(step)
            if (cfg.sample_every and step % cfg.sample_every == 0) or control.take(Command.SAMPLE):
                sample(step)
            if taps_hook is not None and cfg.taps_every and step % cfg.taps_every == 0:
                with preserved_rng():
                    out = taps_hook(model, step)
                for ev in (out if isinstance(out, list) else [out] if out is not None else []):
                    emit(ev)
            if (cfg.save_every and step % cfg.save_every == 0) or control.take(Command.CHECKPOINT):
                save(step)
            if cfg.early_stop and stopper.bad_evals >= cfg.early_stop and step < cfg.steps:
                reason = "early_stopped"
                log(f"early stop at step {step}: validation loss has not improved by "
                    f"{cfg.early_stop_delta:g} for {stopper.bad_evals} evaluations; best/ holds step "
                    f"{stopper.best_step} (val loss {stopper.best_val:.4f})")
                break
            if control.stop_at is not None and step >= control.stop_at and step < cfg.steps:
                reason = "stopped"
                break
    except KeyboardInterrupt:  # between updates the model, RNG and position are the last step's
        reason = "interrupted"
        if in_update:  # the model may be half-way through an update: keep the last checkpoint
            in_update = None
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)

    final_path = None
    if reason != "nan" and in_update is not None and last_saved_step != step and step > 0:
        save(step)
    if reason in ("finished", "early_stopped"):
        final_path = write_final(run, cfg, model, tokenizer, facts, step)  # ranks > 0: None
    msg = {"finished": f"finished {step} steps; result in {final_path}",
           "early_stopped": f"stopped early at step {step}; result in {final_path}; the lowest "
                            f"validation loss is in {run.best_path} (step {stopper.best_step})",
           "stopped": f"stopped at step {step}; checkpoint {last_ckpt}",
           "interrupted": (f"interrupted at step {step}; checkpoint {last_ckpt}; continue with "
                           f"--resume {run.path}" if last_ckpt else
                           f"interrupted at step {step}: nothing was saved (no checkpoint yet); "
                           f"--resume {run.path} starts it again from step 0"),
           "nan": f"loss became non-finite at step {step}; the last good checkpoint is "
                  f"{last_ckpt or 'none (no checkpoint was written)'}"}[reason]
    emit(DoneEvent(step=step, reason=reason, final_path=final_path))
    return TrainResult(run.path, step, reason, final_path, last_ckpt, losses, last_val, msg)


def _sample_prompts(cfg: TrainConfig, tokenizer, dataset: Dataset) -> list[tuple[str, list[int]]]:
    r = Renderer(tokenizer, cfg.mask_prompt)
    out = []
    for text in cfg.sample_prompts:
        ids = (r.render([{"role": "user", "content": text}], True, "sample_prompts")
               if r.has_template else tokenizer.encode(text))
        out.append((text, ids))
    if not out:
        for rec in dataset.valid_records[:2]:
            try:
                ids, _ = rec.format.prompt(rec, r)
            except UserError:
                continue
            out.append((rec.format.prompt_text(rec)[:200], ids))
    return out
