"""The run directory: the one place that knows its layout. No MLX import (the TUI uses it).

    RUN/
      config.yaml            the fully resolved TrainConfig (usable as --config), plus `run:`
                             (the resolved facts: base model path, model config, LoRA layout...)
      metrics.jsonl          one event per line (mlxtoy.events), appended as training goes
      checkpoints/
        step_N/              complete or absent: written to a temp folder, then renamed
          trainable.safetensors   adapters (lora) or the trainable weights (full, scratch)
          optimizer.safetensors   optimizer state, flattened names
          state.json              step, data position, RNG key, elapsed time, tokens seen,
                                  early-stopping state (best validation loss, evaluations since)
      best/                  the weights with the lowest validation loss so far: trainable.safetensors
                             and state.json (val_loss), replaced atomically on each new minimum;
                             no optimizer state (it is for using, not resuming)
      adapters.safetensors + adapter_config.json     final result of a LoRA run
      model.safetensors + model_config.json          final result of a full / scratch run
      tokenizer.json + tokenizer_config.json         scratch runs: the tokenizer used
      accuracy.json          --eval-accuracy: held-out accuracy before and after
      reference_logps.safetensors   DPO without LoRA: the starting model's log-probs of every
                             train / valid pair, computed once before step 1 (resume reuses them)

`locate(path)` turns any path a user may give (a run, one of its checkpoints, RUN/best) into a `RunDir`
and the checkpoint meant; `is_run_or_checkpoint(path)` is the one test of "is this ours".
Writing tensors is the trainer's business (mlxtoy.train.checkpoint); this module only hands
out the atomic folder to write them into.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import yaml

from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.fsutil import atomic_folder, clean_temp, write_text_atomic
from mlxtoy.textio import iter_lines, load_yaml, parse_json, read_json

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
ADAPTERS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"
ACCURACY = "accuracy.json"
REFERENCE_LOGPS = "reference_logps.safetensors"  # DPO without LoRA (see the layout above)
# inside checkpoints/step_N
CKPT_TRAINABLE = "trainable.safetensors"
CKPT_OPTIMIZER = "optimizer.safetensors"
CKPT_STATE = "state.json"
CKPT_OBJECTIVE = "objective.safetensors"  # the objective's own state, when it has one (GRPO: a reused generation)
BEST = "best"  # RUN/best: a checkpoint folder (see the layout above)
LOCK = ".lock"  # the pid (and host) of the process writing the run
RUN_MARKERS = (CONFIG, METRICS, CHECKPOINTS, ADAPTERS, MODEL_WEIGHTS)


def checkpoint_name(step: int) -> str:
    return f"step_{step}"


def checkpoint_step(name: str) -> int | None:
    """`step_N` -> N (None for anything else)."""
    base = os.path.basename(os.path.normpath(name))
    return int(base[5:]) if base.startswith("step_") and base[5:].isdigit() else None


def is_best(path: str) -> bool:
    return os.path.basename(os.path.normpath(path)) == BEST


def is_checkpoint(path: str) -> bool:
    """A complete checkpoint folder (`step_N`, or a run's `best`, with its state.json)."""
    return ((checkpoint_step(path) is not None or is_best(path))
            and os.path.isfile(os.path.join(path, CKPT_STATE)))


def is_run(path: str) -> bool:
    """A folder holding (the start of) a training run."""
    if not os.path.isdir(path):
        return False
    if os.path.exists(os.path.join(path, "config.json")) and not os.path.exists(os.path.join(path, CONFIG)):
        return False  # an HF model folder (it may hold a model.safetensors too)
    return any(os.path.exists(os.path.join(path, m)) for m in RUN_MARKERS)


def is_run_or_checkpoint(path: str) -> bool:
    return is_run(path) or is_checkpoint(path)


@dataclass
class CheckpointState:
    """What a checkpoint restores besides tensors."""

    step: int
    data_position: int  # global index of the next training batch
    rng: list[int]  # mx.random key [hi, lo]
    elapsed: float = 0.0
    tokens_seen: int = 0
    val_loss: float | None = None  # the validation loss at this step, when it was evaluated
    # early stopping and best/: the lowest validation loss so far and its step; the loss that
    # last improved by at least --early-stop-delta, and evaluations since then
    best_val: float | None = None
    best_step: int | None = None
    patience_best: float | None = None
    bad_evals: int = 0

    @classmethod
    def read(cls, ckpt: str) -> "CheckpointState":
        path = os.path.join(ckpt, CKPT_STATE)
        d = read_json(path)
        try:
            state = cls(**d)
            ok = (isinstance(state.step, int) and state.step >= 0 and isinstance(state.data_position, int)
                  and len(state.rng) == 2 and all(isinstance(v, int) for v in state.rng))
        except TypeError as e:
            raise UserError(f"{path}: unreadable checkpoint state ({e})") from None
        if not ok:
            raise UserError(f"{path}: unreadable checkpoint state (bad values)")
        return state


@dataclass
class RunFacts:
    """What config.yaml's `run:` section records besides the TrainConfig (all optional)."""

    mlxtoy_version: str | None = None
    backend: str | None = None
    model_path: str | None = None  # the resolved base model (lora / full)
    tokenizer_path: str | None = None  # scratch with a model's tokenizer
    char_tokenizer: dict[str, Any] | None = None  # scratch with a character vocabulary
    model_config: dict[str, Any] | None = None
    lora: dict[str, Any] | None = None  # targets, rank, alpha, scale, per_head_q, layers...
    lens: dict[str, Any] | None = None  # projection lens: donor and its width
    qlora: bool | None = None
    quantized: dict[str, int] | None = None  # QLoRA: quantized modules by bits/group size
    quantization_error: str | None = None  # QLoRA: what quantizing at load cost
    mixed_precision: str | None = None
    data: dict[str, Any] | None = None  # example counts
    world_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys written by newer versions

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "RunFacts":
        d = dict(d or {})
        known = {k: d.pop(k) for k in list(d) if k in cls.__dataclass_fields__ and k != "extra"}
        return cls(**known, extra=d)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "extra" and v is not None}
        out.update(self.extra)
        return out

    def merged(self, newer: "RunFacts", keep: tuple[str, ...] = ()) -> "RunFacts":
        """These facts updated with `newer`'s, except the `keep` fields (a resume must not
        change what the checkpoints were written for)."""
        mine, theirs = self.to_dict(), newer.to_dict()
        for k in keep:
            theirs.pop(k, None)
        return RunFacts.from_dict({**mine, **theirs})


class RunDir:
    """One run directory: paths, config, metrics and the checkpoints list."""

    read_only = False  # a data-parallel rank > 0 sees the run but writes nothing

    def __init__(self, path: str):
        if not path:
            raise UserError("no output folder (--out RUN)")
        self.path = os.path.abspath(path)

    def join(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    @property
    def metrics_path(self) -> str:
        return self.join(METRICS)

    @property
    def checkpoints_dir(self) -> str:
        return self.join(CHECKPOINTS)

    @property
    def final_path(self) -> str | None:
        """The finished result (adapters or full weights), if the run has one."""
        for name in (ADAPTERS, MODEL_WEIGHTS):
            if os.path.exists(self.join(name)):
                return self.join(name)
        return None

    # ---- lifecycle
    def is_run(self) -> bool:
        return is_run(self.path)

    def check_fresh(self) -> None:
        """Refuse a folder that holds a run with something to keep (a checkpoint or a result)
        or anything that is not ours: nothing of it must be overwritten. A run that stopped
        before its first checkpoint starts again in place."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise UserError(f"{self.path}: exists and is not a folder")
        if self.is_run():
            if self.checkpoints() or self.final_path:
                raise UserError(f"{self.path}: already holds a training run; choose another --out "
                                f"or continue it with --resume {self.path}")
            return
        others = [n for n in os.listdir(self.path) if n != LOCK] if os.path.isdir(self.path) else []
        if others:
            raise UserError(f"{self.path}: a folder that is not a run and not empty ({len(others)} "
                            f"entries, e.g. {sorted(others)[0]!r}); choose a new or empty folder")

    # ---- the lock: one writer per run
    def lock(self) -> None:
        """Take the run for this process (released by `unlock`, or found stale later: a lock
        whose process is gone on this host is taken over)."""
        if self.read_only:
            return
        self._created = not os.path.exists(self.path)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise UserError(f"{self.path}: cannot create the run folder ({e.strerror or e})") from None
        me = f"{os.getpid()} {socket.gethostname()}"
        path = self.join(LOCK)
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._lock_holder()
                if holder is not None:
                    raise UserError(f"{self.path}: in use by another trainer (process {holder}); "
                                    f"wait for it to finish or stop it first") from None
                with contextlib.suppress(OSError):
                    os.unlink(path)  # stale: its process is gone
                continue
            except OSError as e:
                raise UserError(f"{self.path}: cannot write here ({e.strerror or e})") from None
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self._locked = True
            return
        raise UserError(f"{self.path}: could not take the run's lock")

    def _lock_holder(self) -> int | None:
        """The pid holding the lock, if that process is alive (None: free or stale)."""
        try:
            with open(self.join(LOCK), encoding="utf-8", errors="replace") as f:
                pid_s, _, host = f.read().strip().partition(" ")
            pid = int(pid_s)
        except (OSError, ValueError):
            return None
        if host and host != socket.gethostname():
            return pid  # another machine's process: cannot tell, so respect it
        if pid == os.getpid():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        return pid

    def unlock(self, failed: bool = False) -> None:
        """Release the lock; `failed`: the job never started, so a folder that `lock` created
        and nothing else has written into is removed again (bad input leaves no trace)."""
        if getattr(self, "_locked", False):
            with contextlib.suppress(OSError):
                os.unlink(self.join(LOCK))
            self._locked = False
            if failed and getattr(self, "_created", False):
                with contextlib.suppress(OSError):
                    os.rmdir(self.path)  # only if empty

    def create(self, cfg: TrainConfig, facts: RunFacts) -> None:
        os.makedirs(self.checkpoints_dir, exist_ok=True)
        self.write_config(cfg, facts)

    def write_config(self, cfg: TrainConfig, facts: RunFacts) -> None:
        data = cfg.to_dict()
        data["run"] = facts.to_dict()
        write_text_atomic(self.join(CONFIG), yaml.safe_dump(data, sort_keys=False))

    def read_config(self) -> tuple[TrainConfig, RunFacts]:
        path = self.join(CONFIG)
        if not os.path.exists(path):
            raise UserError(f"{self.path}: not a training run (no {CONFIG})")
        data = load_yaml(path)
        return TrainConfig.from_dict(data, source=path), RunFacts.from_dict(data.get("run"))

    def base_model(self) -> str | None:
        """The model a run was trained from (its config.yaml), or None when unreadable."""
        try:
            data = load_yaml(self.join(CONFIG))
        except UserError:
            return None
        model = data.get("model")
        return model if isinstance(model, str) else None

    def write_json(self, name: str, obj: Any) -> str:
        path = self.join(name)
        write_text_atomic(path, json.dumps(obj, indent=2))
        return path

    # ---- metrics
    def append_event(self, line: str) -> None:
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def reset_metrics(self) -> None:
        """A run starting at step 0 begins a new history."""
        if os.path.exists(self.metrics_path):
            os.unlink(self.metrics_path)

    def read_events(self) -> list[dict[str, Any]]:
        return read_metrics(self.metrics_path)

    def truncate_metrics(self, after_step: int) -> None:
        """Drop events of steps past `after_step` (a resumed run redoes them)."""
        if not os.path.exists(self.metrics_path):
            return
        kept = []
        for obj in read_metrics(self.metrics_path):  # a torn or foreign line ends the history
            step = obj.get("step")
            if isinstance(step, (int, float)) and step > after_step:
                continue
            if obj.get("event") == "done":
                continue
            kept.append(json.dumps(obj, separators=(",", ":")) + "\n")
        write_text_atomic(self.metrics_path, "".join(kept))

    # ---- checkpoints
    def checkpoint_path(self, step: int) -> str:
        return os.path.join(self.checkpoints_dir, checkpoint_name(step))

    def checkpoints(self) -> list[tuple[int, str]]:
        """Complete checkpoints, oldest first."""
        out = []
        if os.path.isdir(self.checkpoints_dir):
            for name in os.listdir(self.checkpoints_dir):
                path = os.path.join(self.checkpoints_dir, name)
                if is_checkpoint(path):
                    out.append((checkpoint_step(name), path))
        return sorted(out)

    def latest_checkpoint(self) -> str | None:
        ckpts = self.checkpoints()
        return ckpts[-1][1] if ckpts else None

    def clean_partial(self) -> None:
        """Remove temp folders left by a writer that was killed."""
        clean_temp(self.checkpoints_dir)
        clean_temp(self.path)

    @property
    def best_path(self) -> str:
        return self.join(BEST)

    @contextlib.contextmanager
    def new_best(self) -> Iterator[str]:
        """A temp folder that becomes RUN/best in one rename (the previous best swapped out)."""
        with atomic_folder(self.best_path) as tmp:
            yield tmp

    @contextlib.contextmanager
    def new_checkpoint(self, step: int) -> Iterator[str]:
        """A temp folder to write checkpoint `step` into; it becomes checkpoints/step_N in one
        rename when the block ends without error (re-saving a step swaps the old one out)."""
        with atomic_folder(self.checkpoint_path(step)) as tmp:
            yield tmp

    def prune_checkpoints(self, keep: int) -> None:
        """Keep the newest `keep` checkpoints (0: all)."""
        if keep > 0:
            for _, path in self.checkpoints()[:-keep]:
                shutil.rmtree(path, ignore_errors=True)


def locate(path: str) -> tuple[RunDir, str | None]:
    """RUN, RUN/checkpoints/step_N or RUN/best -> (the run, the checkpoint folder or None for
    "the best available": the final result, else the newest checkpoint)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        if is_best(path) and os.path.isfile(os.path.join(os.path.dirname(path), CONFIG)):
            raise UserError(f"{path}: the run has no best checkpoint yet (it is written at the "
                            f"first evaluation with validation data)")
        if os.path.isfile(path):  # e.g. --adapter RUN/adapters.safetensors
            raise UserError(f"{path}: is a file; give the run's folder (RUN, RUN/checkpoints/step_N or RUN/best)")
        raise UserError(f"{path}: no such run folder")
    if is_checkpoint(path):
        parent = os.path.dirname(path)
        return RunDir(parent if is_best(path) else os.path.dirname(parent)), path
    run = RunDir(path)
    if not os.path.exists(run.join(CONFIG)):
        raise UserError(f"{path}: not a training run (no {CONFIG})")
    return run, None


def read_metrics(path: str) -> list[dict[str, Any]]:
    """metrics.jsonl -> list of event dicts (tolerates a torn last line from a crash)."""
    out = []
    try:
        for _, line in iter_lines(path):
            if not line.strip():
                continue
            obj = parse_json(line, path)
            if not isinstance(obj, dict):
                break
            out.append(obj)
    except UserError:  # not UTF-8 or not JSON: the history ends before that line
        pass
    return out


def find_runs(root: str) -> list[str]:
    """Run directories directly under `root` (those with a metrics.jsonl), newest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        metrics = os.path.join(path, METRICS)
        if os.path.isfile(metrics):
            found.append((os.path.getmtime(metrics), path))
    return [p for _, p in sorted(found, reverse=True)]
