"""The training dashboard: stats, the run's headline curve (the loss; GRPO's reward) with the
objective's other declared values charted beside it (DPO / ORPO: reward margin and pair
accuracy; GRPO: loss and completion length), the taps heat map, samples (GRPO's sampled
completions with their rewards) and the log. What it shows of a run is the objective's
declaration (the start event's `shows`), never a test of the objective or the event's fields.

It renders the app's RunState; it never talks to the trainer except through the app's
commands (pause / resume / stop / sample / checkpoint). Re-rendering is throttled: events mark
the state dirty and a 4 Hz timer redraws, so a burst of events costs one redraw.
"""

from __future__ import annotations

import time

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, RichLog

from mlxtoy.events import Command
from tui.state import RunState
from tui.widgets import LossChart, MetricsChart, NavBar, StatsPanel, TapsHeatmap

LEVEL_STYLE = {"error": "red", "warning": "yellow", "stderr": "dim"}


class DashboardScreen(Screen):
    BINDINGS = [
        Binding("p", "toggle_pause", "Pause", tooltip="Pause or resume training (after the current step)"),
        Binding("s", "stop", "Stop", tooltip="Stop training and save a checkpoint"),
        Binding("g", "sample", "Sample", tooltip="Generate the sample prompts now"),
        Binding("c", "checkpoint", "Checkpoint", tooltip="Save a checkpoint now"),
    ]

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._shown_version = -1
        self._log_seen = 0
        self._samples_seen = 0
        self._state_id = 0
        self._chart_time = 0.0

    def compose(self) -> ComposeResult:
        yield NavBar("train")
        with Vertical(id="dash"):
            yield StatsPanel(id="stats")
            with Horizontal(id="charts"):
                yield LossChart(id="loss-chart")
                yield MetricsChart(id="metrics-chart")  # shown where the objective declares more
            yield TapsHeatmap(id="taps")
            with Horizontal(id="dash-bottom"):
                yield RichLog(id="samples", wrap=True, markup=True, max_lines=200, min_width=20)
                # log lines are never wrapped (a path stays whole, to copy): long ones scroll sideways
                yield RichLog(id="log", wrap=False, markup=True, max_lines=500, min_width=20)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#samples").border_title = "samples"
        self.query_one("#log").border_title = "log"
        self.refresh_view(force=True)
        self.set_interval(0.25, self.refresh_view)

    def on_screen_resume(self) -> None:
        self.refresh_view(force=True)

    @property
    def state(self) -> RunState:
        return self.app.run_state  # type: ignore[attr-defined]

    def refresh_view(self, force: bool = False) -> None:
        state = self.state
        if id(state) != self._state_id:  # a new run (or a reopened one): start the logs over
            self._state_id = id(state)
            self._log_seen = self._samples_seen = 0
            self.query_one("#log", RichLog).clear()
            self.query_one("#samples", RichLog).clear()
            force = True
        if not force and state.version == self._shown_version:
            return
        self._shown_version = state.version
        self.query_one(StatsPanel).show(state)
        chart = self.query_one(LossChart)
        changed = len(chart.steps) != len(state.headline_series[0].steps) or len(chart.val_steps) != len(state.val_steps)
        now = time.monotonic()
        # plotext redraws the whole chart: at most once a second (steps on CPU take seconds anyway)
        if force or (changed and now - self._chart_time >= 1.0):
            steps, evals = state.headline_series
            chart.set_series(steps.steps, steps.values, evals.steps, evals.values, state.metrics[0][0].label)
            more = self.query_one(MetricsChart)
            more.display = any(MetricsChart.charted(state))
            if more.display:
                more.show(state)
            self._chart_time = now
        elif changed:
            self._shown_version = -1  # come back for the chart on the next tick
        self.query_one(TapsHeatmap).show(state)
        log = self.query_one("#log", RichLog)
        for line in state.logs[self._log_seen:]:
            stamp = time.strftime("%H:%M:%S", time.localtime(line.time))
            style = LEVEL_STYLE.get(line.level)
            msg = escape(line.message)
            log.write(f"[dim]{stamp}[/dim] " + (f"[{style}]{msg}[/]" if style else msg), shrink=False)
        self._log_seen = len(state.logs)
        samples = self.query_one("#samples", RichLog)
        for s in state.samples[self._samples_seen:]:
            samples.write(f"[b]step {s.step}[/b] [dim]{escape(str(s.prompt).strip())}[/dim]")
            samples.write(escape(str(s.text).strip()) or "[dim](empty)[/dim]")
        self._samples_seen = len(state.samples)
        if not state.steps and not state.logs and not state.run_dir:
            log.clear()
            log.write("[dim]No run yet: set one up on the Setup screen (F1) and press ctrl+s.[/dim]", shrink=False)
            self._log_seen = 0

    # ---------------------------------------------------------------- controls

    def check_action(self, action: str, parameters) -> bool | None:
        if action in ("toggle_pause", "stop", "sample", "checkpoint"):
            return True if self.app.trainer_alive else None  # type: ignore[attr-defined]
        return True

    async def action_toggle_pause(self) -> None:
        await self.app.toggle_pause()  # type: ignore[attr-defined]

    async def action_stop(self) -> None:
        await self.app.stop_training()  # type: ignore[attr-defined]

    async def action_sample(self) -> None:
        await self.app.send_command(Command.SAMPLE)  # type: ignore[attr-defined]

    async def action_checkpoint(self) -> None:
        await self.app.send_command(Command.CHECKPOINT)  # type: ignore[attr-defined]
