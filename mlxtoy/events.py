"""Typed events that the trainer emits and the CLI / TUI consume.

Every event serialises to one JSON object with an "event" key (`step`, `eval`, `sample`,
`taps`, `checkpoint`, plus `start`, `log` and `done` for run bookkeeping); `metrics.jsonl`
in a run directory is these objects, one per line.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable


@dataclass
class Event:
    event: str = field(init=False, default="")
    time: float = field(init=False, default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


@dataclass
class StartEvent(Event):
    run_dir: str
    method: str
    total_steps: int
    start_step: int
    trainable_params: int
    total_params: int
    config: dict[str, Any]

    def __post_init__(self):
        self.event = "start"


@dataclass
class StepEvent(Event):
    step: int
    loss: float
    lr: float
    tokens: int  # tokens (with loss) in this step
    tokens_per_sec: float
    elapsed: float
    eta: float
    peak_memory_gb: float
    grad_norm: float | None = None

    def __post_init__(self):
        self.event = "step"


@dataclass
class EvalEvent(Event):
    step: int
    val_loss: float
    val_ppl: float
    val_tokens: int

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


@dataclass
class LogEvent(Event):
    message: str
    level: str = "info"

    def __post_init__(self):
        self.event = "log"


@dataclass
class DoneEvent(Event):
    step: int
    reason: str  # "finished", "stopped", "interrupted", "nan"
    final_path: str | None = None

    def __post_init__(self):
        self.event = "done"


EventSink = Callable[[Event], None]


def read_metrics(path: str) -> list[dict[str, Any]]:
    """metrics.jsonl -> list of event dicts (tolerates a torn last line from a crash)."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out
