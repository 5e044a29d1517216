"""What a front end (TUI, signal handler, the trainer process's stdin) can ask of a running loop.

`Control` is the protocol the loop talks to; `TrainControl` is the one implementation for a
single process (thread-safe; commands come from other threads), and the data-parallel
`AgreedControl` (mlxtoy.train.distributed) wraps one so that every rank takes each decision at
the same step. When the loop really pauses or resumes, the control says so with a
`StatusEvent` through `on_status`, so no front end has to infer it.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol

from mlxtoy.events import PAUSED, RUNNING, Command, Event, StatusEvent

# requests served after the current step
REQUESTS = (Command.SAMPLE, Command.CHECKPOINT, Command.EVAL)


class Control(Protocol):
    stop_at: int | None

    @property
    def stop_reason(self) -> str | None: ...

    def stop(self, reason: str = "stopped") -> None: ...

    def take(self, what: Command) -> bool: ...

    def wait_while_paused(self, step: int) -> None: ...


class TrainControl:
    """Thread-safe requests, checked by the loop between steps."""

    def __init__(self, stop_at: int | None = None, on_status: Callable[[Event], None] | None = None):
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self._stop_reason: str | None = None
        self._requests: set[Command] = set()
        self.stop_at = stop_at  # stop (with a checkpoint) once this step is done
        self.on_status = on_status

    def apply(self, cmd: Command) -> None:
        """Carry out one command from a front end."""
        if cmd is Command.PAUSE:
            self.pause()
        elif cmd is Command.RESUME:
            self.resume()
        elif cmd is Command.STOP:
            self.stop("stopped")
        else:
            with self._lock:
                self._requests.add(cmd)

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

    def take(self, what: Command) -> bool:
        """True (once) if `what` was requested since the last call."""
        with self._lock:
            if what in self._requests:
                self._requests.discard(what)
                return True
            return False

    def wait_while_paused(self, step: int) -> None:
        if not self.paused:
            return
        self._status(step, PAUSED)
        while not self._running.wait(timeout=0.2):
            pass
        if not self.stop_reason:
            self._status(step, RUNNING)

    def _status(self, step: int, state: str) -> None:
        if self.on_status is not None:
            self.on_status(StatusEvent(step=step, state=state))
