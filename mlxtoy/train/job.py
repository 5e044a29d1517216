"""The training job: the one orchestration that the CLI, data-parallel ranks and the TUI's
trainer process all run.

    prepare (validate, read data, build the model, create or reopen the run directory)
    -> taps hook -> held-out accuracy before -> train -> accuracy after -> summary, exit code

`run_job` takes where its events go (`emit`), what controls it (`control`) and, for
data-parallel training, the `Parallel` group; it returns a `JobResult` whose `exit_code`
follows the CLI contract (0 finished or stopped, 1 non-finite loss, 130 interrupted). Bad
input raises UserError before anything is written.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import mlx.nn as nn

from mlxtoy import backend, cpujit, settings
from mlxtoy.config import TrainConfig, check_given, resume_check
from mlxtoy.dashboards import check_dashboards, close_all, open_dashboards
from mlxtoy.errors import UserError
from mlxtoy.events import DoneEvent, Event, LogEvent, MetricsSink, fan_out
from mlxtoy.loading import load_tokenizer, quant_plan
from mlxtoy.models.quant import QuantPlan
from mlxtoy.rundir import ACCURACY, CheckpointState, RunDir, RunFacts
from mlxtoy.taps import PROBE_TEXT, TapsProbe
from mlxtoy.train.build import build_model
from mlxtoy.train.checkpoint import pick_checkpoint
from mlxtoy.train.control import Control, TrainControl
from mlxtoy.train.data import Dataset, Renderer, load_dataset
from mlxtoy.train.formats import with_template_kwargs
from mlxtoy.train.objectives import Objective, make_objective
from mlxtoy.train.records import DataOptions, read_data
from mlxtoy.train.evaluate import AccuracyReport, accuracy
from mlxtoy.train.loop import Parallel, TrainResult, epoch_steps, train
from mlxtoy.train.memory import MemoryCheck, check_memory, preflight, set_cache_limit, smaller_settings

EXIT_CODES = {"finished": 0, "early_stopped": 0, "stopped": 0, "interrupted": 130, "nan": 1}


def resume_config(run_path: str, overrides: dict[str, Any]) -> TrainConfig:
    """The config of an existing run with `overrides` applied (by config.resume_check's rule:
    a change to what the checkpoints' shapes depend on is refused; `prepare` names the others)."""
    run = RunDir(run_path)
    if not run.is_run():
        raise UserError(f"{run_path}: not a training run (nothing to resume)")
    cfg, _ = run.read_config()
    recorded = copy.deepcopy(cfg)
    for k, v in overrides.items():
        if k == "out":
            if v and RunDir(v).path != run.path:
                raise UserError(f"--resume continues the run in place; --out {v} differs from {run_path}")
            continue
        setattr(cfg, k, v)
    check_given(cfg, overrides)  # e.g. --qlora on for a full fine-tune's resume
    resume_check(recorded, cfg)  # refused before anything loads
    if "steps" in overrides and "epochs" not in overrides:
        cfg.epochs = 0  # continue to the steps asked for, not the recorded epochs' count
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
    facts: RunFacts
    resume_from: str | None
    notes: list[str] = field(default_factory=list)  # what the job should tell the user
    memory: MemoryCheck | None = None  # the step's estimated peak against the machine's memory
    objective: Objective | None = None  # the run's, built once (load_parts) and handed on


def load_parts(cfg: TrainConfig, old: RunFacts | None = None) -> tuple[nn.Module, Any, Dataset, RunFacts, Objective]:
    """Validate, read the data (format errors, file:line, before the model loads), build the
    model and tokenize: everything but the run directory. `old`: a resumed run's facts (its
    character vocabulary is kept, whatever the data holds now). The objective is built here,
    the one time in a run: memory, the loop and the step take this one."""
    cfg.validate()
    objective = make_objective(cfg)  # its settings checked (a reward file loaded) before any data
    raw = read_data(cfg.data, DataOptions.of(cfg))
    objective.check_records(raw)
    quant = quant_plan(cfg.model, cfg.qlora if cfg.adapters else "off", plan=QuantPlan.of(cfg))

    def measure() -> bool:  # the data's prompts, through the tokenizer build_model gives (the model's)
        return objective.memory_measure(
            raw, lambda: with_template_kwargs(load_tokenizer(cfg.model), cfg.chat_template_kwargs))

    preflight(cfg, quant, check_shapes, objective, measure)
    model, tokenizer, facts = build_model(cfg, char_tokenizer=old.char_tokenizer if old else None, quant=quant)
    tokenizer = with_template_kwargs(tokenizer, cfg.chat_template_kwargs)  # every rendering of the run
    dataset = load_dataset(cfg.data, tokenizer, cfg.seq_len, cfg.mask_prompt, cfg.valid_fraction,
                           cfg.seed, raw=raw, tokenize_fn=objective.tokenize)
    facts.data = {"train_examples": len(dataset.train), "valid_examples": len(dataset.valid),
                  "test_examples": len(dataset.test), "truncated": dataset.train_stats.truncated}
    return model, tokenizer, dataset, facts, objective


def prepare(cfg: TrainConfig, resume: bool = False, run: RunDir | None = None) -> Prepared:
    """Validate, read data, build the model; create the run directory only when all is well."""
    settings.check_all()
    cfg.validate()
    check_dashboards(cfg)
    # MLX's CPU kernels' precompiled header, built beside the model's load, ready before the
    # first step compiles them
    header = cpujit.start_header()
    run = run or RunDir(cfg.out)
    if not resume:
        run.check_fresh()
    run.lock()  # one trainer per run folder, from here until the job ends
    try:
        prepared = _prepare_locked(cfg, resume, run)
    except BaseException:
        run.unlock(failed=True)
        raise
    if header is not None:
        header.join()
    return prepared


def _prepare_locked(cfg: TrainConfig, resume: bool, run: RunDir) -> Prepared:
    old, notes = None, []
    if resume and not run.read_only:
        run.clean_partial()
        recorded, old = run.read_config()
        notes += resume_check(recorded, cfg)  # what the continued run no longer shares with the first
    model, tokenizer, dataset, facts, objective = load_parts(cfg, old)
    memory = check_fits(cfg, model, objective)
    if cfg.epochs:  # config.yaml records the steps the epochs come to
        cfg.steps = epoch_steps(cfg, dataset, objective)
        cfg.validate()
    if cfg.early_stop and not dataset.valid:
        raise UserError(f"{cfg.data}: early_stop needs validation data, and there is none "
                        f"(add a valid split, or a valid_fraction > 0 for a single file)")
    resume_from = None
    if resume and not run.read_only:
        resume_from, picked = pick_checkpoint(run, model)
        notes += picked
        if resume_from is None:
            notes.append(f"{run.path} has no usable checkpoint: training again from step 0")
        facts = old.merged(facts, keep=("lora", "model_config"))  # what checkpoints were written for
    if not run.read_only:
        if not resume and run.is_run():  # stopped before its first checkpoint: start again here
            notes.append(f"{run.path} held a run with no checkpoint: training again from step 0")
        if resume_from is None:
            run.reset_metrics()
        run.create(cfg, facts)
    return Prepared(cfg, run, model, tokenizer, dataset, facts, resume_from, notes, memory, objective)


def check_shapes(cfg: TrainConfig, model: nn.Module) -> None:
    """Refuse, before anything is written, shapes the model cannot take."""
    context = model.config.context_length
    if cfg.method != "scratch" and context and cfg.seq_len > context:
        raise UserError(f"seq_len {cfg.seq_len} is longer than the model's context ({context} tokens)")


def check_fits(cfg: TrainConfig, model: nn.Module, objective: Objective) -> MemoryCheck:
    """`check_shapes`; then estimate the step's peak memory and compare it with the machine's
    (mlxtoy.train.memory: a warning, or with --strict-memory an error, when it will not fit)."""
    check_shapes(cfg, model)
    return check_memory(cfg, model, objective)


class JobParallel(Parallel, Protocol):
    """Data-parallel training as the job sees it: every rank prepares (rank 0 owns the run)."""

    is_main: bool
    size: int

    def prepare(self, build: Callable[[], tuple[TrainConfig, bool]]) -> Prepared: ...


@dataclass
class JobResult:
    result: TrainResult
    summary: dict[str, Any]
    exit_code: int
    accuracy_before: AccuracyReport | None = None
    accuracy_after: AccuracyReport | None = None


def run_job(build: Callable[[], tuple[TrainConfig, bool]], *, emit: Callable[[Event], None] | None = None,
            control: Control | None = None, parallel: JobParallel | None = None,
            on_accuracy: Callable[[str, AccuracyReport], None] | None = None,
            handle_sigint: bool = True) -> JobResult:
    """Build the config (`build` -> (config, resume?)), prepare, train, report.

    emit: every event, besides metrics.jsonl (the run's own sink, rank 0 only).
    on_accuracy("before" | "after", report): with --eval-accuracy, as soon as each is known.
    """
    if parallel is not None:
        p = parallel.prepare(build)
    else:
        cfg, resume = build()
        p = prepare(cfg, resume)
    try:
        return _run_prepared(p, emit, control, parallel, on_accuracy, handle_sigint)
    finally:
        p.run.unlock()


def _run_prepared(p: Prepared, emit, control, parallel, on_accuracy, handle_sigint) -> JobResult:
    cfg, run = p.cfg, p.run
    # dashboards open before step 1 (rank 0 only), so one that cannot start stops nothing
    resumed_at = CheckpointState.read(p.resume_from).step if p.resume_from else 0
    dashboards = [] if run.read_only else open_dashboards(cfg, run, resumed_at)
    try:
        # the weights stay resident while they train (Metal's wired memory; the memory check
        # has already said whether the step fits)
        with backend.wired_limit(p.model, warn=None) as wired:
            return _run_with(p, fan_out(None if run.read_only else MetricsSink(run), *dashboards, emit),
                             control, parallel, on_accuracy, handle_sigint, wired)
    except RuntimeError as e:  # MLX ran out of memory: one line naming what takes less
        error = backend.out_of_memory_error(e, "training", smaller_settings(cfg, p.facts.qlora))
        if error is None:
            raise
        raise error from None
    finally:
        close_all(dashboards)


def _run_with(p: Prepared, send, control, parallel, on_accuracy, handle_sigint, wired: str | None = None
              ) -> JobResult:
    cfg, run = p.cfg, p.run
    for note in p.notes:
        send(LogEvent(message=note, level="warning"))
    if p.facts.qlora:  # what the base is kept in, and what quantizing at load cost
        kept = ", ".join(f"{n} modules {layout}" for layout, n in (p.facts.quantized or {}).items())
        error = p.facts.quantization_error
        send(LogEvent(message=f"QLoRA base: {kept}" + (f"; {error}" if error else "")))
    if p.memory is not None:
        send(LogEvent(message=p.memory.line()))
        if not p.memory.fits:
            send(LogEvent(message=p.memory.warning(), level="warning"))
        limits = ", ".join(filter(None, (wired, set_cache_limit(p.memory))))
        if limits:
            send(LogEvent(message=limits))
    if parallel is not None:
        send(LogEvent(message=f"data-parallel over {parallel.size} ranks: {cfg.batch_size // parallel.size} "
                              f"of the {cfg.batch_size} rows of every batch per rank"))
    control = control or TrainControl()
    if control.stop_reason:  # stopped while loading: nothing trained, nothing to save
        send(LogEvent(message="stopped before training started"))
        done = DoneEvent(step=0, reason="stopped")
        send(done)
        result = TrainResult(run.path, 0, "stopped", message="stopped before training started")
        return JobResult(result, _summary(result, parallel), 0)
    main = parallel is None or parallel.is_main
    hook = make_taps_hook(p.tokenizer, p.dataset, cfg.taps_every) if cfg.taps_every > 0 and main else None

    def measure(label: str) -> AccuracyReport:
        # every rank measures (the same greedy answers), so none waits at a collective
        if label == "before":
            send(LogEvent(message=f"measuring held-out accuracy before training "
                                  f"({len(p.dataset.test)} test examples)"))
        rep = accuracy(p.model, p.tokenizer, p.dataset.test, limit=cfg.accuracy_examples)
        send(LogEvent(message=f"{label}: held-out accuracy {rep.accuracy:.1%} ({rep.correct}/{rep.total})"))
        if on_accuracy is not None and main:
            on_accuracy(label, rep)
        return rep

    before = measure("before") if cfg.eval_accuracy else None
    result = train(cfg, p.model, p.tokenizer, p.dataset, run, facts=p.facts, resume_from=p.resume_from,
                   emit=send, control=control, taps_hook=hook, handle_sigint=handle_sigint,
                   parallel=parallel, objective=p.objective)
    summary = _summary(result, parallel)
    after = None
    if cfg.eval_accuracy and result.reason in ("finished", "early_stopped"):
        after = measure("after")
        summary["accuracy_before"], summary["accuracy_after"] = before.accuracy, after.accuracy
        if not run.read_only:
            run.write_json(ACCURACY, {"before": before.to_dict(), "after": after.to_dict()})
    return JobResult(result, summary, EXIT_CODES.get(result.reason, 1), before, after)


def make_taps_hook(tokenizer, dataset: Dataset, every: int) -> TapsProbe:
    """A TapsProbe over a fixed text (the first validation prompt, else PROBE_TEXT)."""
    tokens: list[int] = []
    for rec in dataset.valid_records[:1]:
        try:
            tokens = Renderer(tokenizer).prompt_of(rec)[0]
        except UserError:
            tokens = []
    if len(tokens) < 8:
        tokens = tokenizer.encode(PROBE_TEXT)
    return TapsProbe(tokens[:64], every, heads=False)


def _summary(result: TrainResult, parallel: JobParallel | None) -> dict[str, Any]:
    out = {"run": result.run_dir, "step": result.step, "reason": result.reason,
           "result": result.final_path, "checkpoint": result.last_checkpoint,
           "final_loss": result.losses[-1] if result.losses else None, "val_loss": result.val_loss}
    if parallel is not None:
        out["world_size"] = parallel.size
    return out
