"""The mlxtoy terminal UI: Setup, Train (dashboard), Chat and Runs screens.

The app owns three things and nothing else: the trainer child process (events in, commands
out; see tui/process.py), the RunState those events fold into, and the MLX thread used for
chat. Screens render the state and call the app's commands; training logic lives in mlxtoy.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from typing import Any, Callable

from textual import events
from textual.app import App
from textual._time import get_time  # the clock Textual stamps key events with
from textual.binding import Binding

from mlxtoy.events import CheckpointEvent, Command, Event
from tui.chat import ChatScreen
from tui.dashboard import DashboardScreen
from tui.generation import Generator, MLXThread
from tui.process import TrainerProcess, remote_argv, trainer_env
from tui.runs import RunsScreen
from tui.setup import SetupScreen
from tui.state import DONE, FAILED, PAUSED, RUNNING, STARTING, STOPPING, RunState

DEFAULT_MODEL = "smollm2-135m"


class LatencyProbe:
    """How quickly the event loop reacts while training runs.

    key: seconds from a key event's creation (when the terminal input was parsed, or when a
    test pilot pressed it) to the end of the action it triggered. lag: how late a 50 ms timer
    fires, i.e. how long the loop was busy with something else.
    """

    def __init__(self) -> None:
        self.key: deque[float] = deque(maxlen=10_000)
        self.lag: deque[float] = deque(maxlen=10_000)
        self.by_action: dict[str, deque[float]] = {}

    def record_key(self, action: str, seconds: float) -> None:
        self.key.append(seconds)
        self.by_action.setdefault(action, deque(maxlen=1000)).append(seconds)

    @staticmethod
    def _pct(values, q: float) -> float:
        v = sorted(values)
        return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0

    def _stats(self, v) -> dict[str, Any]:
        return {"n": len(v), "median_ms": 1e3 * self._pct(v, 0.5), "p95_ms": 1e3 * self._pct(v, 0.95),
                "max_ms": 1e3 * max(v, default=0.0)}

    def report(self) -> dict[str, Any]:
        return {"key": self._stats(self.key), "lag": self._stats(self.lag),
                "by_action": {a: self._stats(v) for a, v in sorted(self.by_action.items())}}


class MlxtoyApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "mlxtoy"
    MODES = {"setup": SetupScreen, "train": DashboardScreen, "chat": ChatScreen, "runs": RunsScreen}
    DEFAULT_MODE = "setup"
    BINDINGS = [
        Binding("f1", "switch_mode('setup')", "Setup", show=False),
        Binding("f2", "switch_mode('train')", "Train", show=False),
        Binding("f3", "switch_mode('chat')", "Chat", show=False),
        Binding("f4", "switch_mode('runs')", "Runs", show=False),
        Binding("ctrl+t", "toggle_theme", "Theme"),
        Binding("q", "request_quit", "Quit"),
        Binding("ctrl+c", "request_quit", "Quit", show=False, priority=True),
        Binding("ctrl+q", "request_quit", "Quit", show=False, priority=True),
    ]

    def __init__(self, model: str | None = None, data: str | None = None, runs_dir: str = "runs",
                 trainer_argv: Callable[[dict[str, Any]], list[str]] | None = None,
                 mode: str = "setup", theme: str = "textual-dark") -> None:
        super().__init__()
        self.model_arg = model or DEFAULT_MODEL
        self.data_arg = data
        self.runs_dir = runs_dir
        self.trainer_argv = trainer_argv or remote_argv
        self.start_mode = mode
        self.initial_theme = theme
        self.run_state = RunState()
        self.trainer: TrainerProcess | None = None
        self.mlx = MLXThread()
        self.generator = Generator()
        self.gen_cancel = threading.Event()  # set to end a streaming reply (Esc, or quitting)
        self.chat_source_hint: str | None = None
        self.latency = LatencyProbe()
        self._quitting = False
        self._checkpoint_waiters: list[asyncio.Future] = []
        self._key_time: float | None = None
        self._tick_due = 0.0

    def on_mount(self) -> None:
        self.theme = self.initial_theme
        if self.start_mode != "setup":
            self.switch_mode(self.start_mode)
        self._tick_due = time.monotonic() + 0.05
        self.set_interval(0.05, self._tick)

    # ---------------------------------------------------------------- latency probe

    def _tick(self) -> None:
        now = time.monotonic()
        self.latency.lag.append(max(0.0, now - self._tick_due))
        self._tick_due = now + 0.05

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.Key):
            self._key_time = event.time
        elif isinstance(event, events.MouseDown):
            self._key_time = None  # an action from a click is not a key press
        await super().on_event(event)

    async def run_action(self, action, default_namespace=None) -> bool:
        key_time, self._key_time = self._key_time, None
        result = await super().run_action(action, default_namespace)
        if key_time is not None:
            self.latency.record_key(str(action).split("(")[0], get_time() - key_time)
        return result

    # ---------------------------------------------------------------- helpers for screens

    @property
    def trainer_alive(self) -> bool:
        return self.trainer is not None and self.trainer.running

    def current_model(self) -> str:
        """The model named on the Setup screen (or --model)."""
        try:
            for screen in self._screen_stacks.get("setup", []):
                value = screen.query_one("#f-model").value.strip()
                if value:
                    return value
        except Exception:
            pass
        return self.model_arg

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.theme == "textual-dark" else "textual-dark"

    def _refresh_bindings(self) -> None:
        try:
            self.screen.refresh_bindings()
        except Exception:
            pass

    # ---------------------------------------------------------------- training

    def start_training(self, cfg: dict[str, Any], device: str | None = None) -> None:
        """Start the trainer on `cfg` (TrainConfig fields), computing on `device` ("cpu", "gpu";
        None: the GPU where there is one)."""
        if self.trainer_alive:
            self.notify("A run is already training.", severity="warning")
            return
        state = RunState(run_dir=os.path.abspath(cfg["out"]), status=STARTING, method=cfg["method"],
                         total_steps=int(cfg["steps"]), config=dict(cfg))
        state.log(f"starting the trainer: {cfg['method']} on {cfg['model']}, data {cfg['data']}"
                  + (f", on the {device.upper()}" if device else "") + " (loading the model takes a moment)")
        self.run_state = state
        self.trainer = TrainerProcess(self.trainer_argv(cfg), self._on_trainer_event, self._on_trainer_exit,
                                      env=trainer_env(device))
        self.run_worker(self._run_trainer(self.trainer), group="trainer", exit_on_error=False)
        self.switch_mode("train")
        self._refresh_bindings()

    async def _run_trainer(self, trainer: TrainerProcess) -> None:
        try:
            await trainer.start()
        except OSError as e:
            self.run_state.status = FAILED
            self.run_state.log(f"could not start the trainer: {e}", "error")
            return
        await trainer.pump()

    def _on_trainer_event(self, ev: Event) -> None:
        before = self.run_state.status
        self.run_state.apply(ev)
        if isinstance(ev, CheckpointEvent):
            for fut in self._checkpoint_waiters:
                if not fut.done():
                    fut.set_result(ev.path)
            self._checkpoint_waiters.clear()
        if self.run_state.status != before:
            self._refresh_bindings()

    def _on_trainer_exit(self, code: int, stderr_tail: list[str]) -> None:
        state = self.run_state
        if code != 0:
            state.status = FAILED
            shown = {line.message for line in state.logs if line.level == "error"}
            errors = [line for line in stderr_tail if line.startswith("error:")]
            for line in (errors or stderr_tail[-8:]):
                if line.removeprefix("error: ") not in shown:  # the bridge already sent it as an event
                    state.log(line, "error")
            state.log(f"the trainer exited with code {code}", "error")
        elif state.status != DONE:
            state.status = DONE
            state.log("the trainer exited")
        for fut in self._checkpoint_waiters:
            if not fut.done():
                fut.set_result(None)
        self._checkpoint_waiters.clear()
        self._refresh_bindings()

    async def send_command(self, cmd: Command | str) -> bool:
        if not self.trainer_alive:
            self.notify("No run is training.", severity="warning")
            return False
        assert self.trainer is not None
        cmd = Command(cmd)
        ok = await self.trainer.send(cmd)
        if ok and cmd in (Command.SAMPLE, Command.CHECKPOINT):
            self.run_state.log(f"{cmd.value} requested (after the current step)")
        return ok

    async def toggle_pause(self) -> None:
        state = self.run_state
        if not self.trainer_alive or self.trainer is None:
            self.notify("No run is training.", severity="warning")
            return
        if state.status == PAUSED:
            if await self.send_command(Command.RESUME):
                state.status = RUNNING
                state.log("resume requested")
        elif state.status in (RUNNING, STARTING):
            # A checkpoint at the pause puts the paused weights on disk, so Chat can load them
            # (a paused trainer serves no requests until it resumes).
            if await self.trainer.send(Command.CHECKPOINT) and await self.send_command(Command.PAUSE):
                state.status = PAUSED
                state.log("pause requested: the trainer saves a checkpoint and pauses after the current step")
        self._refresh_bindings()

    async def stop_training(self) -> None:
        if await self.send_command(Command.STOP):
            self.run_state.status = STOPPING
            self.run_state.log("stop requested: the trainer saves the run and exits")
            self._refresh_bindings()

    async def checkpoint_and_wait(self, timeout: float = 600.0) -> str | None:
        """Ask for a checkpoint of the current weights; -> its folder (None if none came)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._checkpoint_waiters.append(fut)
        if not await self.send_command(Command.CHECKPOINT):
            self._checkpoint_waiters.remove(fut)
            return None
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None

    async def current_weights(self, timeout: float = 600.0) -> str | None:
        """A checkpoint folder holding the run's current weights (None if none comes).

        Running: ask for a checkpoint and wait for it. Paused: the checkpoint written at the
        pause (see toggle_pause), waiting for it if the trainer is still finishing its step.
        """
        state = self.run_state
        if state.status != PAUSED:
            return await self.checkpoint_and_wait(timeout)
        if state.checkpoints and state.checkpoints[-1][0] >= state.step:
            return state.checkpoints[-1][1]
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._checkpoint_waiters.append(fut)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None

    def open_run(self, state: RunState) -> bool:
        """Show a finished run on the dashboard (not while one trains)."""
        if self.trainer_alive:
            return False
        self.run_state = state
        self.switch_mode("train")
        return True

    # ---------------------------------------------------------------- quitting

    async def action_request_quit(self) -> None:
        if not self.trainer_alive:
            self._quit_now()
            return
        assert self.trainer is not None
        if self._quitting:  # asked twice: do not wait any longer
            self.trainer.kill()
            self._quit_now()
            return
        self._quitting = True
        self.notify("Saving the run before quitting… (press q again to quit without waiting)",
                    timeout=60)
        await self.stop_training()  # stop also wakes a paused trainer
        self.run_worker(self._quit_when_saved(self.trainer), group="quit")

    async def _quit_when_saved(self, trainer: TrainerProcess) -> None:
        await trainer.wait()
        self._quit_now()

    def _quit_now(self) -> None:
        self.gen_cancel.set()  # a reply being generated ends at its next token
        self.mlx.shutdown()
        self.exit()

    async def on_unmount(self) -> None:
        # Closing stdin tells the bridge to stop and save; give it the chance, then make sure.
        if self.trainer_alive and self.trainer is not None:
            await self.trainer.send(Command.STOP)
            if await self.trainer.wait(timeout=30) is None:
                self.trainer.kill()
