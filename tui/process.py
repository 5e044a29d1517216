"""The trainer as a child process: JSON events in on its stdout, JSON commands out on its stdin.

Training runs in `python -m mlxtoy.train.remote` so the UI's event loop never waits on MLX:
a training step holds the CPU for seconds, and a thread in this process would also compete for
the GIL and MLX's thread-local streams. Reading is asyncio (non-blocking), so key presses are
handled while events stream in.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import deque
from typing import Any, Callable

from mlxtoy import settings
from mlxtoy.events import Command, Event, LogEvent, event_from_dict

LINE_LIMIT = 64 * 1024 * 1024  # a taps event with per-head views can be a long line


def remote_argv(config: dict[str, Any]) -> list[str]:
    """The command line that trains `config` and speaks the event protocol."""
    return [sys.executable, "-m", "mlxtoy.train.remote", "--config", json.dumps(config)]


def trainer_env(device: str | None) -> dict[str, str]:
    """The trainer's environment: this process's, with MLXTOY_DEVICE set to `device` ("cpu" or
    "gpu"), or unset for None (the GPU where there is one), as `--device` does for a command."""
    env = dict(os.environ)
    env.pop(settings.DEVICE.name, None)
    if device:
        env[settings.DEVICE.name] = device
    return env


class TrainerProcess:
    """Start the trainer, stream its events to `on_event`, send it commands.

    on_event(Event) gets every event line, typed; on_exit(returncode, stderr_tail) is called once
    when the process has ended and its output is drained.
    """

    def __init__(self, argv: list[str], on_event: Callable[[Event], None],
                 on_exit: Callable[[int, list[str]], None], cwd: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.on_event = on_event
        self.on_exit = on_exit
        self.cwd = cwd
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.stderr_tail: deque[str] = deque(maxlen=40)
        self.returncode: int | None = None
        self._ended = asyncio.Event()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.returncode is None

    async def start(self) -> None:
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=self.cwd, env=env, limit=LINE_LIMIT,
            start_new_session=True)  # Ctrl-C in the terminal reaches the UI, not the trainer

    async def pump(self) -> int:
        """Read events until the process ends; returns its exit code."""
        assert self.proc is not None
        await asyncio.gather(self._read_stdout(), self._read_stderr())
        self.returncode = await self.proc.wait()
        self._ended.set()
        self.on_exit(self.returncode, list(self.stderr_tail))
        return self.returncode

    async def _read_stdout(self) -> None:
        assert self.proc and self.proc.stdout
        while True:
            try:
                line = await self.proc.stdout.readline()
            except (asyncio.LimitOverrunError, ValueError):
                continue  # a line past LINE_LIMIT: drop it, keep the stream
            if not line:
                return
            text = line.decode("utf-8", "replace").strip()
            if not text:
                continue
            try:
                ev = event_from_dict(json.loads(text))
            except json.JSONDecodeError:
                ev = LogEvent(message=text)
            if ev is not None:  # a kind this version does not know is skipped
                self.on_event(ev)

    async def _read_stderr(self) -> None:
        assert self.proc and self.proc.stderr
        while True:
            line = await self.proc.stderr.readline()
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip()
            if text:
                self.stderr_tail.append(text)

    async def send(self, cmd: Command | str) -> bool:
        """Send one command; False when the trainer is gone."""
        cmd = Command(cmd)  # ValueError for anything that is not a command
        if not self.running or self.proc is None or self.proc.stdin is None:
            return False
        try:
            self.proc.stdin.write((cmd.to_line() + "\n").encode())
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            return False
        return True

    async def wait(self, timeout: float | None = None) -> int | None:
        try:
            await asyncio.wait_for(self._ended.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        return self.returncode

    def kill(self) -> None:
        if self.running and self.proc is not None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
