"""A run served from the Runs screen: `mlxtoy serve` as a child process (the UI never loads the
model itself), started on a free localhost port and stopped with Ctrl-C's signal, which lets
the requests in flight finish."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import deque

from mlxtoy.config import ADAPTER_METHODS  # runs served as an adapter on their base; others as the model


def serve_argv(run_dir: str, method: str) -> list[str]:
    """The command that serves `run_dir`: an adapter run on its own base (a request's "model"
    picks the run by its folder name, or the base), any other run as the model."""
    target = ["--adapter", run_dir] if method in ADAPTER_METHODS else [run_dir]
    return [sys.executable, "-m", "mlxtoy", "serve", *target, "--port", "0"]


class ServeProcess:
    def __init__(self, argv: list[str]):
        self.argv = argv
        self.proc: asyncio.subprocess.Process | None = None
        self.url: str | None = None
        self.tail: deque[str] = deque(maxlen=20)
        self._drain: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, timeout: float = 300.0) -> str:
        """Start it; -> its base URL once it listens. RuntimeError with its last lines if it
        ends first (a bad run, say) or does not listen within `timeout` seconds."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
        try:
            self.url = await asyncio.wait_for(self._listening(), timeout)
        except asyncio.TimeoutError:
            self.stop()
            raise RuntimeError(f"the server did not start within {timeout:.0f} s") from None
        if self.url is None:
            await self.proc.wait()
            raise RuntimeError(self.tail[-1] if self.tail else f"the server exited with code {self.proc.returncode}")
        self._drain = asyncio.create_task(self._read_rest())
        return self.url

    async def _listening(self) -> str | None:
        assert self.proc is not None and self.proc.stderr is not None
        while True:
            line = await self.proc.stderr.readline()
            if not line:
                return None
            text = line.decode("utf-8", "replace").rstrip()
            self.tail.append(text)
            if text.startswith("serving on "):
                return text.split()[-1]

    async def _read_rest(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.tail.append(line.decode("utf-8", "replace").rstrip())

    def stop(self) -> None:
        """Ask it to finish (the requests in flight complete, then it exits)."""
        if self.running and self.proc is not None:
            try:
                self.proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                pass

    async def wait(self, timeout: float | None = None) -> int | None:
        if self.proc is None:
            return None
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            return None
