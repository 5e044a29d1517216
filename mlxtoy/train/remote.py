"""The trainer as a child process: `python -m mlxtoy.train.remote --config JSON`.

Protocol (what the TUI, or any other front end, speaks; the types live in mlxtoy.events):
- stdout: one event per line, as JSON (the same lines as metrics.jsonl, plus `status` events
  when the loop really pauses or resumes). Nothing else is ever written there: stray prints
  go to stderr.
- stdin: one `Command` per line, `{"cmd": "pause"}` (or just `pause`). Samples, checkpoints
  and evals happen after the current step; stop saves a checkpoint and ends the run. End of
  input (the front end went away) = stop.
- exit code: 0 finished or stopped, 2 bad input (an `error` log event and `error: ...` on
  stderr), 1 internal error or a non-finite loss, 130 interrupted.

`--config` is a JSON object of TrainConfig fields, or a path to a .json / .yaml file of them.
It runs the same job as `mlxtoy train` (mlxtoy.train.job).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback
from typing import Any, TextIO

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.events import Command, Event, LogEvent
from mlxtoy.textio import load_yaml, parse_json, read_json
from mlxtoy.train.control import TrainControl
from mlxtoy.train.job import resume_config, run_job


class EventWriter:
    """Events -> JSON lines on the protocol stream, one whole line at a time."""

    def __init__(self, out: TextIO):
        self.out = out
        self.lock = threading.Lock()
        self.step = 0

    def __call__(self, ev: Event) -> None:
        step = getattr(ev, "step", None)
        if isinstance(step, int):
            self.step = step
        line = ev.to_json()
        with self.lock:
            try:
                self.out.write(line + "\n")
                self.out.flush()
            except (BrokenPipeError, ValueError):
                pass  # the front end is gone; the run still finishes and saves

    def log(self, message: str, level: str = "info") -> None:
        self(LogEvent(message=message, level=level))


def read_commands(stream: TextIO, control: TrainControl, writer: EventWriter) -> None:
    """Apply commands from `stream` until it ends; then stop (the front end went away)."""
    for line in stream:
        if not line.strip():
            continue
        cmd = Command.parse(line)
        if cmd is None:
            writer.log(f"unknown command {line.strip()[:80]!r} "
                       f"(commands: {', '.join(c.value for c in Command)})", "warning")
        else:
            control.apply(cmd)
    control.stop("stopped")


def load_config(text: str) -> dict[str, Any]:
    """--config (a JSON object, or a .json / .yaml file) -> the dict of TrainConfig fields."""
    if text.lstrip().startswith("{"):
        data = parse_json(text, "--config")
    elif text.endswith((".yaml", ".yml")):
        data = load_yaml(text)
    else:
        data = read_json(text)
    if not isinstance(data, dict):
        raise UserError("--config: expected an object of config fields")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlxtoy.train.remote", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="JSON object of TrainConfig fields, or a .json/.yaml file")
    ap.add_argument("--resume", action="store_true", help="continue the run in config.out")
    args = ap.parse_args(argv)

    # The protocol owns the real stdout; everything else printed (by us, libraries or C code)
    # goes to stderr so it can never corrupt an event line.
    events_out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr

    writer = EventWriter(events_out)
    control = TrainControl(on_status=writer)
    threading.Thread(target=read_commands, args=(sys.stdin, control, writer), daemon=True,
                     name="commands").start()

    def build() -> tuple[TrainConfig, bool]:
        data = load_config(args.config)
        if args.resume:  # the run's own config, with only the fields given here changed
            cfg = resume_config(data.get("out", ""), {k: v for k, v in data.items() if k != "out"})
        else:
            cfg = TrainConfig.from_dict(data, source="--config")
        writer.log(f"loading {cfg.model} and reading {cfg.data}")
        return cfg, args.resume

    try:
        job = run_job(build, emit=writer, control=control)
    except UserError as e:
        writer.log(str(e), "error")
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        writer.log("interrupted while loading", "error")
        return 130
    except Exception as e:
        traceback.print_exc()
        writer.log(f"internal error: {type(e).__name__}: {e}", "error")
        return 1
    finally:
        sys.stderr.flush()
    print(job.result.message, file=sys.stderr)
    return job.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
