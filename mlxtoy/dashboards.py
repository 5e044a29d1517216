"""Dashboards: event sinks that stream what metrics.jsonl holds to TensorBoard and W&B.

`check_dashboards(cfg)` runs before anything is written (a target that is not installed is
one UserError); `open_dashboards(cfg, run)` opens the sinks before step 1 (an init that fails,
W&B online without a login, is a UserError too, never a crash mid-run). Each sink takes
every event (mlxtoy.events) and keeps what it can show:

    step    train/loss, train/lr, train/tokens_per_sec, train/peak_memory_gb, train/grad_norm,
            train/reward_* and train/pref_accuracy (preference objectives); grpo's values
            under their TRL names (train/reward, train/rewards/<name>/mean, train/kl, ...)
    eval    val/loss, val/ppl, val/pref_accuracy, val/reward_margin
    taps    taps/<site>/layer<N>: the activation histogram (and its rms as a scalar)
    sample  samples: prompt and generation as text

TensorBoard writes RUN/tensorboard (tensorboardX; `tensorboard --logdir RUN`); W&B logs to
the project $WANDB_PROJECT (default mlxtoy) with the run folder's name, files under RUN/wandb (W&B's own folder),
and honours WANDB_MODE (offline: nothing leaves the machine; `wandb sync` uploads later).
Both libraries are optional extras (mlxtoy[tensorboard], mlxtoy[wandb]), imported on use.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import numpy as np

from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.events import EvalEvent, Event, SampleEvent, StepEvent, TapsEvent
from mlxtoy.rundir import RunDir

TENSORBOARD_DIR = "tensorboard"  # inside the run directory
MODULES = {"tensorboard": "tensorboardX", "wandb": "wandb"}
STEP_SCALARS = ("loss", "lr", "tokens_per_sec", "peak_memory_gb", "grad_norm", "reward_chosen",
                "reward_rejected", "reward_margin", "pref_accuracy")
EVAL_SCALARS = {"val_loss": "loss", "val_ppl": "ppl", "pref_accuracy": "pref_accuracy",
                "reward_margin": "reward_margin"}


def scalars(ev: Event) -> dict[str, float]:
    """The dashboard scalars of one event, by tag (empty for other events)."""
    if isinstance(ev, StepEvent):  # and the objective's own values (grpo: train/reward, ...)
        pairs = {f"train/{k}": getattr(ev, k) for k in STEP_SCALARS} | {f"train/{k}": v for k, v in ev.extra.items()}
    elif isinstance(ev, EvalEvent):
        pairs = {f"val/{tag}": getattr(ev, k) for k, tag in EVAL_SCALARS.items()} | {
            f"val/{k}": v for k, v in ev.extra.items()}
    elif isinstance(ev, TapsEvent):
        pairs = {f"{tap_tag(s)}/rms": s.get("rms") for s in ev.stats}
    else:
        return {}
    return {k: float(v) for k, v in pairs.items() if isinstance(v, (int, float)) and np.isfinite(v)}


def tap_tag(stat: dict[str, Any]) -> str:
    return f"taps/{stat['site']}/layer{stat['layer']}"


def tap_histogram(stat: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(counts, edges) of a taps stat: its equal-width bins over hist_edges' range."""
    counts = np.asarray(stat["hist"], dtype=np.float64)
    lo, hi = stat["hist_edges"]
    return counts, np.linspace(lo, hi, len(counts) + 1)


class TensorBoardSink:
    """Events -> TensorBoard event files under RUN/tensorboard. A resumed run passes the step
    it resumes from: what an earlier process logged past it is purged (it is redone)."""

    def __init__(self, logdir: str, resumed_at: int = 0):
        try:
            from tensorboardX import SummaryWriter  # optional extra, imported on use

            # event files are named by the second they start in: a resume within the same
            # second must not reopen (and truncate) the earlier file, and must sort after it
            self.writer = SummaryWriter(logdir=logdir, purge_step=resumed_at + 1 if resumed_at else None,
                                        filename_suffix=f".step{resumed_at:09d}.{os.getpid()}")
        except Exception as e:  # a broken install (e.g. a protobuf it cannot use), a bad folder
            raise UserError(f"--report-to tensorboard: TensorBoard did not start "
                            f"({type(e).__name__}: {e})") from None

    def __call__(self, ev: Event) -> None:
        step = getattr(ev, "step", None)
        if step is None:
            return
        for tag, value in scalars(ev).items():
            self.writer.add_scalar(tag, value, step)
        if isinstance(ev, TapsEvent):
            for s in ev.stats:
                counts, edges = tap_histogram(s)
                n = counts.sum()
                if n <= 0:
                    continue
                self.writer.add_histogram_raw(
                    tap_tag(s), min=float(edges[0]), max=float(edges[-1]), num=int(n),
                    sum=float(s.get("mean", 0.0)) * n, sum_squares=float(s.get("rms", 0.0)) ** 2 * n,
                    bucket_limits=edges[1:].tolist(), bucket_counts=counts.tolist(), global_step=step)
        elif isinstance(ev, SampleEvent):
            self.writer.add_text("samples", f"**{ev.prompt}**\n\n{ev.text}", step)
        if isinstance(ev, (EvalEvent, SampleEvent)):
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Events -> a W&B run (WANDB_MODE=offline: a local run folder under RUN/wandb)."""

    def __init__(self, cfg: TrainConfig, run: RunDir):
        try:
            import wandb  # optional extra, imported on use

            self.wandb = wandb
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mlxtoy"),
                                  name=os.path.basename(run.path), dir=run.path,
                                  config=cfg.to_dict(), reinit="create_new")
        except Exception as e:  # wandb raises its own kinds (no login, no network, bad key)
            raise UserError(f"--report-to wandb: W&B did not start ({type(e).__name__}: {e}); "
                            f"log in with `wandb login`, or set WANDB_MODE=offline") from None
        self.samples: list[list[Any]] = []

    def __call__(self, ev: Event) -> None:
        step = getattr(ev, "step", None)
        if step is None:
            return
        data: dict[str, Any] = dict(scalars(ev))
        if isinstance(ev, TapsEvent):
            for s in ev.stats:
                counts, edges = tap_histogram(s)
                data[tap_tag(s)] = self.wandb.Histogram(np_histogram=(counts.tolist(), edges.tolist()))
        elif isinstance(ev, SampleEvent):
            self.samples.append([step, ev.prompt, ev.text])
            data["samples"] = self.wandb.Table(columns=["step", "prompt", "text"], data=list(self.samples))
        if data:
            self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


def check_dashboards(cfg: TrainConfig) -> None:
    """Refuse --report-to targets that cannot work, before anything is written."""
    for name in cfg.report_to:
        module = MODULES[name]
        if importlib.util.find_spec(module) is None:
            raise UserError(f"--report-to {name}: {module} is not installed "
                            f"(pip install 'mlxtoy[{name}]')")


def open_dashboards(cfg: TrainConfig, run: RunDir, resumed_at: int = 0) -> list[Any]:
    """The sinks of cfg.report_to, opened (each has close()); `resumed_at`: the step a resumed
    run continues from (W&B: a new W&B run holds the resumed part)."""
    check_dashboards(cfg)
    sinks: list[Any] = []
    try:
        for name in cfg.report_to:
            if name == "tensorboard":
                sinks.append(Guarded(TensorBoardSink(run.join(TENSORBOARD_DIR), resumed_at), name))
            elif name == "wandb":
                sinks.append(Guarded(WandbSink(cfg, run), name))
    except BaseException:
        close_all(sinks)
        raise
    return sinks


def close_all(sinks: list[Any]) -> None:
    for sink in sinks:
        sink.close()


class Guarded:
    """A dashboard sink that cannot stop training: its first failure mid-run (a network
    error, a full disk) is reported on stderr once and the dashboard is dropped."""

    def __init__(self, sink: Any, name: str):
        self.sink, self.name, self.failed = sink, name, False

    def __call__(self, ev: Event) -> None:
        if self.failed:
            return
        try:
            self.sink(ev)
        except Exception as e:
            self.failed = True
            print(f"warning: --report-to {self.name} stopped ({type(e).__name__}: {e}); "
                  f"training goes on, metrics.jsonl has everything", file=sys.stderr)

    def close(self) -> None:
        if not self.failed:
            try:
                self.sink.close()
            except Exception as e:
                print(f"warning: --report-to {self.name}: closing failed ({type(e).__name__}: {e})",
                      file=sys.stderr)
