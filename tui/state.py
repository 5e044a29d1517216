"""What the UI knows about a run: the event stream folded into series and a status.

Pure Python (no Textual, no MLX): the dashboard renders a RunState, the Runs screen builds one
from a finished run's metrics.jsonl, and tests can check it directly.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from mlxtoy.events import (PAUSED as STATUS_PAUSED, CheckpointEvent, DoneEvent, EvalEvent, Event,
                           LogEvent, Metric, SampleEvent, StartEvent, StatusEvent, StepEvent, TapsEvent,
                           event_from_dict, shows_of)
from mlxtoy.rundir import RunDir, find_runs

TAP_SITES = ("attn_norm", "ffn_out", "resid_post")

# status of the run as the UI sees it
IDLE, STARTING, RUNNING, PAUSED, STOPPING, DONE, FAILED = (
    "idle", "starting", "running", "paused", "stopping", "done", "failed")


@dataclass
class LogLine:
    time: float
    level: str  # info | warning | error
    message: str


@dataclass
class Series:
    """One declared metric's points: the steps and the values."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, step: int, value: float | None) -> None:
        if value is not None:
            self.steps.append(step)
            self.values.append(value)

    def cut(self, step: int) -> None:
        """Forget the points from `step` on (a resumed run goes on from there)."""
        keep = sum(1 for s in self.steps if s < step)
        del self.steps[keep:], self.values[keep:]


def sample_text(record: dict[str, Any]) -> str:
    """A sampled completion that a step event carries (`samples`), with the values the
    objective recorded beside it (their names as recorded; nested ones flattened)."""
    values = []
    for k, v in record.items():
        for name, x in (v.items() if isinstance(v, dict) else [(k, v)]):
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                values.append(f"{name} {x:.2f}")
    shown = f"  ⟨{', '.join(values)}⟩" if values else ""
    return f"{record.get('completion', '')}{shown}"


@dataclass
class RunState:
    run_dir: str = ""
    status: str = IDLE
    method: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    total_steps: int = 0
    start_step: int = 0
    trainable_params: int = 0
    total_params: int = 0
    shows: dict[str, Any] | None = None  # the objective's display declaration (its start event)
    # each declared metric's points, {key: Series}: of the step events and of the eval events
    step_series: dict[str, Series] = field(default_factory=dict)
    eval_series: dict[str, Series] = field(default_factory=dict)
    last_eval: EvalEvent | None = None
    # training series (one point per step event)
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    last_step: StepEvent | None = None
    # validation series
    val_steps: list[int] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    samples: list[SampleEvent] = field(default_factory=list)
    taps: TapsEvent | None = None  # the latest taps event
    checkpoints: list[tuple[int, str]] = field(default_factory=list)
    logs: list[LogLine] = field(default_factory=list)
    done_reason: str = ""
    final_path: str | None = None
    version: int = 0  # bumped on every change; views re-render when it moves

    # ------------------------------------------------------------------ folding events

    def apply(self, ev: Event | dict[str, Any]) -> None:
        """Fold one event (typed, or its JSON dict) into the state."""
        if isinstance(ev, dict):
            ev = event_from_dict(ev)
        handler = getattr(self, f"_on_{ev.event}", None) if ev is not None else None
        if handler is not None:
            handler(ev)
            self.version += 1

    def log(self, message: str, level: str = "info", when: float | None = None) -> None:
        self.logs.append(LogLine(when if when is not None else time.time(), level, message))
        self.version += 1

    def _on_start(self, ev: StartEvent) -> None:
        self.run_dir = ev.run_dir or self.run_dir
        self.method = ev.method
        self.config = dict(ev.config or {})
        self.total_steps = int(ev.total_steps or 0)
        self.start_step = int(ev.start_step or 0)
        self.trainable_params = int(ev.trainable_params or 0)
        self.total_params = int(ev.total_params or 0)
        self.shows = ev.shows
        if self.status in (IDLE, STARTING):
            self.status = RUNNING
        resumed = f", resumed at step {self.start_step}" if self.start_step else ""
        self.logs.append(LogLine(ev.time, "info",
                                 f"started {self.method} run: {self.total_steps} steps, "
                                 f"{fmt_count(self.trainable_params)} of "
                                 f"{fmt_count(self.total_params)} parameters trained{resumed}"))

    def _on_step(self, ev: StepEvent) -> None:
        step = int(ev.step)
        if self.steps and step <= self.steps[-1]:  # a resumed run replays nothing, but be safe
            cut = next(i for i, s in enumerate(self.steps) if s >= step)
            del self.steps[cut:], self.losses[cut:], self.lrs[cut:]
            for series in self.step_series.values():
                series.cut(step)
        for m in self.metrics[0]:
            self.step_series.setdefault(m.key, Series()).add(step, m.value(ev))
        self.steps.append(step)
        self.losses.append(float(ev.loss) if ev.loss is not None else math.nan)
        self.lrs.append(float(ev.lr or 0.0))
        for s in ev.extra.get("samples") or []:  # completions the step sampled (its own records)
            self._on_sample(SampleEvent(step=step, prompt=str(s.get("prompt", "")), text=sample_text(s)))
        self.last_step = ev
        if self.status == STARTING:
            self.status = RUNNING

    def _on_eval(self, ev: EvalEvent) -> None:
        self.last_eval = ev
        eval_metrics = self.metrics[1]
        for m in eval_metrics:
            self.eval_series.setdefault(m.key, Series()).add(int(ev.step), m.value(ev))
        self.val_steps.append(int(ev.step))
        self.val_losses.append(float(ev.val_loss) if ev.val_loss is not None else math.nan)
        shown = ", ".join(f"{m.label} {m.text(ev)}" for m in eval_metrics)
        self.logs.append(LogLine(ev.time, "info", f"step {ev.step}: {shown}"))

    def _on_sample(self, ev: SampleEvent) -> None:
        self.samples.append(ev)
        del self.samples[:-20]

    def _on_taps(self, ev: TapsEvent) -> None:
        self.taps = ev

    def _on_checkpoint(self, ev: CheckpointEvent) -> None:
        self.checkpoints.append((int(ev.step), ev.path))
        self.logs.append(LogLine(ev.time, "info", f"step {ev.step}: checkpoint {ev.path}"))

    def _on_status(self, ev: StatusEvent) -> None:
        # the trainer confirms that it really paused or resumed (between steps)
        if ev.state == STATUS_PAUSED:
            if self.status in (RUNNING, STARTING, PAUSED):
                self.status = PAUSED
            self.logs.append(LogLine(ev.time, "info", f"paused at step {ev.step}"))
        else:
            if self.status == PAUSED:
                self.status = RUNNING
            self.logs.append(LogLine(ev.time, "info", f"resumed at step {ev.step}"))

    def _on_log(self, ev: LogEvent) -> None:
        self.logs.append(LogLine(ev.time, ev.level or "info", str(ev.message)))

    def _on_done(self, ev: DoneEvent) -> None:
        self.done_reason = str(ev.reason or "")
        self.final_path = ev.final_path
        self.status = DONE
        where = f": {self.final_path}" if self.final_path else ""
        self.logs.append(LogLine(ev.time, "info", f"done at step {ev.step} ({self.done_reason}){where}"))

    # ------------------------------------------------------------------ derived values

    @property
    def step(self) -> int:
        return self.steps[-1] if self.steps else self.start_step

    @property
    def active(self) -> bool:
        return self.status in (STARTING, RUNNING, PAUSED, STOPPING)

    def summary(self) -> dict[str, str]:
        """Short labelled values for the stats panel."""
        s = self.last_step
        step_metrics, eval_metrics = self.metrics
        out = {
            "status": self.status + (f" ({self.done_reason})" if self.done_reason else ""),
            "step": f"{self.step}/{self.total_steps or '?'}",
            step_metrics[0].label: step_metrics[0].text(s),  # the headline first
            eval_metrics[0].label: eval_metrics[0].text(self.last_eval),
            "lr": f"{float(s.lr):.2e}" if s else "-",
            "tok/s": f"{float(s.tokens_per_sec):.0f}" if s else "-",
            "eta": fmt_duration(float(s.eta)) if s and self.status not in (DONE, FAILED) else "-",
            "elapsed": fmt_duration(float(s.elapsed)) if s else "-",
            "mem": f"{float(s.peak_memory_gb):.2f} GB" if s else "-",
        }
        for m in step_metrics[1:]:  # the objective's other values
            out[m.label] = m.text(s)
        return out

    @property
    def metrics(self) -> tuple[list[Metric], list[Metric]]:
        """(the step events' metrics, the eval events') the objective declared, the first of
        each its headline; a run from before the declaration: its loss."""
        return shows_of(self.shows)

    def headline(self) -> tuple[str, str, str, str]:
        """(label, latest value, eval label, latest eval value) of the run's headline."""
        step_metrics, eval_metrics = self.metrics
        return (step_metrics[0].label, step_metrics[0].text(self.last_step),
                eval_metrics[0].label, eval_metrics[0].text(self.last_eval))

    def series(self, m: Metric, of_eval: bool = False) -> Series:
        """A declared metric's points (none yet: empty)."""
        return (self.eval_series if of_eval else self.step_series).get(m.key) or Series()

    @property
    def headline_series(self) -> tuple[Series, Series]:
        """The headline's points: per step, and per evaluation (GRPO: the reward; SFT: the loss)."""
        step_metrics, eval_metrics = self.metrics
        return self.series(step_metrics[0]), self.series(eval_metrics[0], of_eval=True)

    def taps_grid(self, metric: str = "rms") -> tuple[int, list[str], dict[tuple[int, str], float]]:
        """-> (n_layers, sites, {(layer, site): value}) from the latest taps event."""
        values: dict[tuple[int, str], float] = {}
        for row in (self.taps.stats if self.taps is not None else []) or []:
            try:
                values[(int(row["layer"]), str(row["site"]))] = float(row[metric])
            except (KeyError, TypeError, ValueError):
                continue
        if not values:
            return 0, [], {}
        n_layers = max(layer for layer, _ in values) + 1
        present = {site for _, site in values}
        sites = [s for s in TAP_SITES if s in present] + sorted(present - set(TAP_SITES))
        return n_layers, sites, values

    # ------------------------------------------------------------------ from disk

    @classmethod
    def from_events(cls, events: list[Event | dict[str, Any]], run_dir: str = "") -> "RunState":
        state = cls(run_dir=run_dir, status=STARTING)
        for ev in events:
            state.apply(ev)
        if run_dir:
            state.run_dir = run_dir  # where it is now, not where it was trained
        if state.status != DONE:
            state.status = "incomplete" if state.steps else IDLE  # still training, or killed
        return state

    @classmethod
    def from_run_dir(cls, run_dir: str) -> "RunState":
        return cls.from_events(RunDir(run_dir).read_events(), run_dir)


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "-"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


@dataclass
class RunInfo:
    """One row of the Runs screen: a run directory summarised from its metrics.jsonl."""

    path: str
    name: str
    method: str
    steps: str
    loss: str
    val_loss: str
    status: str
    modified: float


def headline_text(label: str, value: str, column: str) -> str:
    """A Runs table cell: the value, named when the run's headline is not what the column is."""
    return value if label == column or value == "-" else f"{label} {value}"


def scan_runs(root: str) -> list[RunInfo]:
    """Run directories under `root` (those with a metrics.jsonl), newest first."""
    out: list[RunInfo] = []
    for path in find_runs(root) if root else []:
        try:
            state = RunState.from_run_dir(path)
        except (OSError, ValueError, KeyError):
            continue
        out.append(RunInfo(
            path=path, name=os.path.basename(path), method=state.method or "?",
            steps=f"{state.step}/{state.total_steps or '?'}",
            loss=headline_text(*state.headline()[:2], "loss"),
            val_loss=headline_text(*state.headline()[2:], "val"),
            status=state.done_reason or state.status,
            modified=os.path.getmtime(RunDir(path).metrics_path)))
    return out
