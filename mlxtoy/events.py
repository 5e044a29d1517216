"""The trainer/front-end protocol, typed both ways.

Trainer -> front end: events. Every event serialises to one JSON object with an "event" key
(`step`, `eval`, `sample`, `taps`, `checkpoint`, plus `start`, `status`, `log` and `done` for
run bookkeeping) and comes back with `event_from_dict`; `metrics.jsonl` in a run directory is
these objects, one per line (one sink among others: `MetricsSink`).

Front end -> trainer: `Command`s, one per line (`{"cmd": "pause"}` or just `pause`), parsed by
`Command.parse`. The TUI, the trainer process and the test double all use this one list."""

from __future__ import annotations

import enum
import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Protocol


@dataclass
class Event:
    event: str = field(init=False, default="")
    time: float = field(init=False, default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        # non-finite floats become null: metrics.jsonl stays valid JSON
        return json.dumps(_finite(self.to_dict()), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Event":
        """The event a `to_dict` gave (keys this version does not know are ignored)."""
        kw = {f.name: d[f.name] for f in fields(cls) if f.init and f.name in d}
        ev = cls(**kw)
        if isinstance(d.get("time"), (int, float)):
            ev.time = float(d["time"])
        return ev


class Extras:
    """An event whose objective adds named values besides its fields (GRPO's `reward`,
    `rewards/<name>/mean`, `completions/mean_length`, ... as TRL names them): they sit in
    `extra` and serialise at the top level of the event's JSON object, beside the fields."""

    extra: dict[str, Any]

    @classmethod
    def of(cls, values: dict[str, Any], **kw: Any):
        """The event with `kw` and `values` (a field's value goes to that field, the rest to extra)."""
        names = {f.name for f in fields(cls) if f.init}
        return cls(**kw, **{k: v for k, v in values.items() if k in names},
                   extra={k: v for k, v in values.items() if k not in names})

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.update(d.pop("extra"))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Event":
        ev = super().from_dict(d)
        names = {f.name for f in fields(cls)}
        ev.extra = {k: v for k, v in d.items() if k not in names}
        return ev


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


@dataclass(frozen=True)
class Metric:
    """A value the displays show of a run (the CLI's progress line, the TUI, the Runs table):
    its key in the step or eval event (a field, or one of the objective's extras), its label
    and its format. Each objective declares its own (mlxtoy.train.objectives)."""

    key: str
    label: str
    fmt: str = ".4f"
    chart: bool = True  # the TUI charts it (beyond the headline); False: printed only

    def value(self, ev: "Event | None") -> float | None:
        """This metric's number in a step or eval event (None when the event has none)."""
        if ev is None:
            return None
        v = getattr(ev, self.key, None) if self.key in {f.name for f in fields(ev)} else getattr(ev, "extra", {}).get(self.key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    def text(self, ev: "Event | None") -> str:
        v = self.value(ev)
        return "-" if v is None else format(v, self.fmt)


# A run's display declaration as the start event carries it: {"step": [[key, label, fmt], ...],
# "eval": [...]}, the first of each the run's headline. A run written before the start event
# carried one shows its loss, as it did then.
DEFAULT_SHOWS = {"step": [["loss", "loss", ".4f"]], "eval": [["val_loss", "val", ".4f"], ["val_ppl", "ppl", ".2f", False]]}


def shows_of(declared: dict[str, Any] | None) -> tuple[list[Metric], list[Metric]]:
    """(the step events' metrics, the eval events') of a start event's `shows`."""
    d = declared or DEFAULT_SHOWS
    return ([Metric(*m) for m in d.get("step") or DEFAULT_SHOWS["step"]],
            [Metric(*m) for m in d.get("eval") or DEFAULT_SHOWS["eval"]])


@dataclass
class StartEvent(Event):
    run_dir: str
    method: str
    total_steps: int
    start_step: int
    trainable_params: int
    total_params: int
    config: dict[str, Any]
    shows: dict[str, Any] | None = None  # the objective's display declaration (see DEFAULT_SHOWS)

    def __post_init__(self):
        self.event = "start"


@dataclass
class StepEvent(Extras, Event):
    step: int
    loss: float
    lr: float
    tokens: int  # tokens (with loss) in this step
    tokens_per_sec: float
    elapsed: float
    eta: float
    peak_memory_gb: float
    grad_norm: float | None = None
    # preference objectives (dpo, orpo): batch means; accuracy = share of pairs whose chosen
    # reward is above the rejected one's
    reward_chosen: float | None = None
    reward_rejected: float | None = None
    reward_margin: float | None = None
    pref_accuracy: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # the objective's own values (see Extras)

    def __post_init__(self):
        self.event = "step"


@dataclass
class EvalEvent(Extras, Event):
    step: int
    val_loss: float
    val_ppl: float
    val_tokens: int  # tokens (sft) or pairs (dpo, orpo) the mean is over
    pref_accuracy: float | None = None  # preference objectives, over the validation pairs
    reward_margin: float | None = None
    # the objective's own values (see Extras); grpo: `reward`, the mean reward of greedy
    # completions of the validation prompts (val_loss is minus it: best/ keeps the highest)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.event = "eval"


@dataclass
class SampleEvent(Event):
    step: int
    prompt: str
    text: str

    def __post_init__(self):
        self.event = "sample"


@dataclass
class TapsEvent(Event):
    step: int
    # one entry per (layer, site): {"layer", "site", "mean", "rms", "max_abs", "zero_frac", "hist", "hist_edges"}
    stats: list[dict[str, Any]]
    heads: list[dict[str, Any]] = field(default_factory=list)  # per layer per head views

    def __post_init__(self):
        self.event = "taps"


@dataclass
class CheckpointEvent(Event):
    step: int
    path: str

    def __post_init__(self):
        self.event = "checkpoint"


# what StatusEvent.state can say
RUNNING, PAUSED = "running", "paused"


@dataclass
class StatusEvent(Event):
    """The loop really paused or resumed (between steps), so front ends need not guess."""

    step: int
    state: str  # running | paused

    def __post_init__(self):
        self.event = "status"


@dataclass
class LogEvent(Event):
    message: str
    level: str = "info"

    def __post_init__(self):
        self.event = "log"


@dataclass
class DoneEvent(Event):
    step: int
    reason: str  # "finished", "early_stopped", "stopped", "interrupted", "nan"
    final_path: str | None = None

    def __post_init__(self):
        self.event = "done"


EVENT_TYPES: dict[str, type[Event]] = {
    "start": StartEvent, "step": StepEvent, "eval": EvalEvent, "sample": SampleEvent,
    "taps": TapsEvent, "checkpoint": CheckpointEvent, "status": StatusEvent, "log": LogEvent,
    "done": DoneEvent,
}


def event_from_dict(d: dict[str, Any]) -> Event | None:
    """A JSON event object -> its typed event (None for a kind or shape this version does not
    know: a newer trainer may send more)."""
    cls = EVENT_TYPES.get(d.get("event")) if isinstance(d, dict) else None
    if cls is None:
        return None
    try:
        return cls.from_dict(d)
    except TypeError:  # a required field is missing
        return None


class EventSink(Protocol):
    def __call__(self, ev: Event) -> None: ...


class MetricsSink:
    """Appends every event to a run's metrics.jsonl (through anything with `append_event`)."""

    def __init__(self, run: Any):
        self.run = run

    def __call__(self, ev: Event) -> None:
        self.run.append_event(ev.to_json())


def fan_out(*sinks: "EventSink | None") -> Callable[[Event], None]:
    """One sink that hands each event to every given sink, in order."""
    live = [s for s in sinks if s is not None]

    def emit(ev: Event) -> None:
        for sink in live:
            sink(ev)

    return emit


class Command(str, enum.Enum):
    """What a front end can ask of a running trainer. Samples, checkpoints and evaluations
    happen after the current step; stop saves a checkpoint and ends the run."""

    PAUSE = "pause"
    RESUME = "resume"
    STOP = "stop"
    SAMPLE = "sample"
    CHECKPOINT = "checkpoint"
    EVAL = "eval"

    def to_line(self) -> str:
        return json.dumps({"cmd": self.value})

    @classmethod
    def parse(cls, line: str) -> "Command | None":
        """`{"cmd": "pause"}` or `pause` -> Command.PAUSE; None for anything else."""
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                return None
            line = obj.get("cmd") if isinstance(obj, dict) else None
        try:
            return cls(line)
        except ValueError:
            return None
