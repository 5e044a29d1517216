"""`mlxtoy train`: LoRA, full fine-tuning or from-scratch training (SFT, DPO, ORPO or GRPO), headless.

Every TrainConfig field is a flag of the same name (`_` -> `-`); flags override `--config
FILE.yaml`, which overrides the defaults (every option: docs/configuration.md). `--steps` is the
total, so `--resume RUN --steps 2N` continues a run stopped at N up to 2N. Progress and events go
to stderr: a progress bar on a terminal (step, loss, the objective's metrics, tokens/s, ETA),
else plain lines (a step line every twentieth of the run), never wrapped. Stdout gets the result
summary (and with --eval-accuracy the accuracy report before and after).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from mlxtoy.config import ALL_METHODS, TrainConfig, check_given, train_sections
from mlxtoy.console import stderr_console
from mlxtoy.errors import UserError
from mlxtoy.events import Event, shows_of
from mlxtoy.textio import load_yaml
from mlxtoy.train import distributed
from mlxtoy.train.control import TrainControl
from mlxtoy.train.evaluate import AccuracyReport
from mlxtoy.train.job import resume_config, run_job


def _flag_type(tp: Any):
    """The argparse `type` for a dataclass field type (lists are comma-separated strings)."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (list,) or (args and typing.get_origin(args[0]) is list):
        return str
    if args:
        tp = args[0]
    return {int: int, float: float, str: str}.get(tp, str)


def _flag_help(f: dataclasses.Field) -> str:
    """Help text from the field's metadata, with its choices and default (argparse's %-format)."""
    meta = f.metadata
    text = meta.get("help", "")
    methods = meta.get("methods")
    if methods and len(methods) < len(ALL_METHODS):
        text += f" [{'/'.join(methods)}]"
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(default, list):
        default = ",".join(map(str, default)) if default else None
    if default not in (None, "", {}):
        text += f" (default: {default})"
    return text.replace("%", "%%")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="LoRA, full fine-tuning or from-scratch training",
                       usage="%(prog)s [--config FILE.yaml] [--model MODEL] --data DATA --out RUN [options]\n"
                             "       %(prog)s --resume RUN [options]",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE.yaml", help="a YAML file of config fields")
    p.add_argument("--resume", metavar="RUN", help="continue the run in RUN from its newest checkpoint")
    p.add_argument("--stop-at", type=int, metavar="N",
                   help="stop after step N with a checkpoint (the schedule still spans --steps)")
    p.add_argument("--distributed", action="store_true",
                   help="data-parallel over the ranks started by mlx.launch (automatic when "
                        "launched by it); --batch-size is the global batch")
    p.add_argument("--dist-timeout", type=float, metavar="SECONDS", default=None,
                   help="stop the job when a collective waits this long for a rank (default 300)")
    hints = typing.get_type_hints(TrainConfig)
    for title, section in train_sections():  # one group of flags per section of the config
        group = p.add_argument_group(title)
        for f in section:
            flag = "--" + f.name.replace("_", "-")
            tp = hints[f.name]
            choices = f.metadata.get("choices")
            if tp is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                   help=_flag_help(f))
            elif f.name == "sample_prompts":
                group.add_argument(flag, dest=f.name, action="append", default=None, help=_flag_help(f))
            else:
                # choices are shown, and checked by TrainConfig.validate (the one validator, whose
                # messages name the field the same way for the CLI, YAML and the TUI)
                metavar = "{" + ",".join(choices) + "}" if choices else f.name.upper()
                group.add_argument(flag, dest=f.name, type=_flag_type(tp), default=None,
                                   help=_flag_help(f), metavar=metavar)
    return p


def _overrides(args) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is None:
            continue
        if f.name in ("lora_targets", "report_to"):
            v = [t.strip() for t in v.split(",") if t.strip()]
        elif f.name == "lora_layers":
            v = [int(t) for t in v.split(",") if t.strip()] if v.strip().lower() != "all" else None
        elif f.name == "betas":
            v = [float(t) for t in v.split(",")]
        out[f.name] = v
    return out


def build_config(args) -> tuple[TrainConfig, bool]:
    try:
        overrides = _overrides(args)
    except ValueError as e:
        raise UserError(f"bad flag value ({e})") from None
    if args.resume:
        if args.config:
            raise UserError("--resume takes the run's own config.yaml; drop --config")
        return resume_config(args.resume, overrides), True
    if "epochs" in overrides and "steps" in overrides and overrides["epochs"]:
        raise UserError("--epochs and --steps are alternatives: give one")
    given = load_yaml(args.config) if args.config else {}
    cfg = TrainConfig.from_dict(given, source=args.config) if args.config else TrainConfig()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg.__post_init__()
    check_given(cfg, [*given, *overrides])  # none dropped: e.g. --qlora with --method full is refused
    if not cfg.data:
        raise UserError("train needs --data PATH (or `data:` in --config)")
    if not cfg.out:
        raise UserError("train needs --out RUN (or `out:` in --config)")
    return cfg, False


class ProgressView:
    """Events -> a rich progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, quiet: bool = False):
        self.console = stderr_console()
        self.tty = sys.stderr.isatty() and not quiet
        self.progress = None
        self.task = None
        self.total = 0
        self.every = 1
        # the objective's declared values (its start event's), of step and eval events
        self.step_metrics, self.eval_metrics = shows_of(None)

    def _start_bar(self, ev) -> None:
        self.total = ev.total_steps
        self.every = max(1, ev.total_steps // 20)
        if not self.tty:
            return
        self.progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("{task.fields[shown]}"), TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("ETA {task.fields[eta]}"), console=self.console, transient=False)
        self.progress.start()
        self.task = self.progress.add_task("train", total=ev.total_steps, completed=ev.start_step,
                                           shown=self.shown(None), tps="-", eta="-")

    def shown(self, ev) -> str:
        """The objective's declared values of a step event, its headline first."""
        return ", ".join(f"{m.label} {m.text(ev)}" for m in self.step_metrics)

    def print(self, msg: str) -> None:
        (self.progress.console if self.progress else self.console).print(msg, markup=False)

    def __call__(self, ev: Event) -> None:
        kind = ev.event
        if kind == "start":
            self.print(f"training {ev.method}: {ev.trainable_params:,} trainable of "
                       f"{ev.total_params:,} parameters; {ev.run_dir}")
            self.step_metrics, self.eval_metrics = shows_of(ev.shows)
            self._start_bar(ev)
        elif kind == "step":
            shown = self.shown(ev)
            if self.progress:
                self.progress.update(self.task, completed=ev.step, shown=shown,
                                     tps=f"{ev.tokens_per_sec:.0f}", eta=_fmt_time(ev.eta))
            elif ev.step % self.every == 0 or ev.step == self.total:
                self.print(f"step {ev.step}/{self.total} {shown} lr {ev.lr:.2e} "
                           f"{ev.tokens_per_sec:.0f} tok/s ETA {_fmt_time(ev.eta)}")
        elif kind == "eval":  # the objective's declared values, its headline first
            self.print(f"step {ev.step}: " + ", ".join(f"{m.label} {m.text(ev)}" for m in self.eval_metrics))
        elif kind == "sample":
            self.print(f"step {ev.step} sample: {ev.prompt[:60]!r} -> {ev.text[:120]!r}")
        elif kind == "checkpoint":
            self.print(f"step {ev.step}: checkpoint {ev.path}")
        elif kind == "log":
            if _is_accuracy_result(ev):
                return  # the CLI prints the report itself, on stdout (_print_accuracy)
            self.print(("warning: " if ev.level == "warning" else "") + ev.message
                       if ev.level != "error" else ev.message)
        elif kind == "done":
            self.close()

    def close(self) -> None:
        if self.progress:
            self.progress.stop()
            self.progress = None


def _fmt_time(s: float) -> str:
    s = int(max(0, s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _is_accuracy_result(ev: Event) -> bool:
    """The job's log line of a held-out accuracy result ("after: held-out accuracy 99.0% ...").
    The job logs it for metrics.jsonl and the TUI; the CLI prints the whole report on stdout,
    so its stderr view skips the line: each result is printed once."""
    return ev.message.startswith(("before: held-out accuracy", "after: held-out accuracy"))


def _print_accuracy(label: str, rep: AccuracyReport, n_samples: int = 5) -> None:
    print(f"{label}: held-out accuracy {rep.accuracy:.1%} ({rep.correct}/{rep.total})")
    for s in rep.samples[:n_samples]:
        mark = "ok " if s["ok"] else "bad"
        print(f"  [{mark}] {s['prompt']!r} -> {s['answer']!r} (expected {s['expected']!r})")
    sys.stdout.flush()


def run(args) -> int:
    """One job, in this process or as one rank of a data-parallel group (mlx.launch)."""
    try:
        dist = distributed.setup(getattr(args, "distributed", False), getattr(args, "dist_timeout", None))
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    main = dist is None or dist.is_main
    view = ProgressView() if main else None  # rank 0 prints and writes; the others train silently
    try:
        job = run_job(lambda: build_config(args), emit=view, control=TrainControl(stop_at=args.stop_at),
                      parallel=dist, on_accuracy=_print_accuracy)
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if view is not None:
            view.close()
    if not main:
        return job.exit_code
    if job.result.reason == "nan":
        print(f"error: {job.result.message}", file=sys.stderr)
        return 1
    view.print(job.result.message)
    print(json.dumps(job.summary))
    return job.exit_code
