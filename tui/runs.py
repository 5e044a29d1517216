"""Runs: earlier runs under the runs folder, read from their metrics.jsonl, with their charts."""

from __future__ import annotations

import os
import time

from rich.markup import escape
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Label, Static

from tui.export import ExportScreen
from tui.serving import ServeProcess, serve_argv
from tui.state import RunInfo, RunState, scan_runs
from tui.widgets import LossChart, NavBar


class RunsScreen(Screen):
    BINDINGS = [
        Binding("r", "refresh", "Refresh"),
        Binding("o", "open", "Open in dashboard"),
        Binding("t", "talk", "Chat with run"),
        Binding("e", "export", "Export"),
        Binding("v", "serve", "Serve", tooltip="Serve the run on an OpenAI-compatible localhost port (again: stop)"),
    ]

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.runs: list[RunInfo] = []
        self.selected: RunState | None = None
        self.server: ServeProcess | None = None  # `mlxtoy serve` of a run, while it runs

    def compose(self) -> ComposeResult:
        yield NavBar("runs")
        with Vertical(id="runs"):
            with Horizontal(classes="row"):
                yield Label("runs folder", classes="flabel")
                yield Input(self.app.runs_dir, id="runs-dir", compact=True)  # type: ignore[attr-defined]
            yield DataTable(id="runs-table", cursor_type="row", zebra_stripes=True)
            yield Static("", id="run-summary")
            yield LossChart(id="run-chart")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("run", "method", "steps", "loss", "val", "status", "modified")
        self.action_refresh()
        table.focus()

    def on_screen_resume(self) -> None:
        self.action_refresh()

    def action_refresh(self) -> None:
        root = self.query_one("#runs-dir", Input).value.strip()
        self.runs = scan_runs(os.path.expanduser(root))
        table = self.query_one(DataTable)
        keep = table.cursor_row
        table.clear()
        for r in self.runs:
            table.add_row(r.name, r.method, r.steps, r.loss, r.val_loss, r.status,
                          time.strftime("%m-%d %H:%M", time.localtime(r.modified)), key=r.path)
        if not self.runs:
            self.query_one("#run-summary", Static).update(
                f"[dim]No runs under {escape(root or '?')} (a run folder has a metrics.jsonl).[/dim]")
            self.query_one(LossChart).set_series([], [], [], [])
            self.selected = None
        else:
            table.move_cursor(row=min(max(keep, 0), len(self.runs) - 1))
            self._show(min(max(keep, 0), len(self.runs) - 1))

    @on(Input.Submitted, "#runs-dir")
    def _dir_changed(self) -> None:
        self.app.runs_dir = self.query_one("#runs-dir", Input).value.strip()  # type: ignore[attr-defined]
        self.action_refresh()
        self.query_one(DataTable).focus()

    @on(DataTable.RowHighlighted)
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show(event.cursor_row)

    @on(DataTable.RowSelected)
    def _selected(self, event: DataTable.RowSelected) -> None:
        self._show(event.cursor_row)
        self.action_open()

    def _show(self, row: int) -> None:
        if not 0 <= row < len(self.runs):
            return
        info = self.runs[row]
        try:
            state = RunState.from_run_dir(info.path)
        except OSError as e:
            self.query_one("#run-summary", Static).update(f"[red]{escape(str(e))}[/red]")
            return
        self.selected = state
        cfg = state.config
        parts = [f"[b]{escape(info.name)}[/b]", f"{state.method or '?'}",
                 f"model {escape(str(cfg.get('model', '?')))}", f"{len(state.steps)} steps logged",
                 f"{len(state.val_steps)} evals", f"{len(state.checkpoints)} checkpoints"]
        text = "  ".join(parts)
        if state.samples:
            s = state.samples[-1]
            text += f"\n[dim]last sample (step {s.step}):[/dim] {escape(' '.join(str(s.text).split())[:200])}"
        self.query_one("#run-summary", Static).update(text)
        # the run's headline (GRPO: the reward, sampled and held-out greedy; SFT: the loss)
        steps, evals = state.headline_series
        self.query_one(LossChart).set_series(steps.steps, steps.values, evals.steps, evals.values,
                                             state.metrics[0][0].label)

    def action_open(self) -> None:
        if self.selected is None:
            return
        if not self.app.open_run(self.selected):  # type: ignore[attr-defined]
            self.notify("A run is training: its dashboard stays on F2.", severity="warning")

    def action_talk(self) -> None:
        if self.selected is None:
            return
        self.app.chat_source_hint = f"run:{self.selected.run_dir}"  # type: ignore[attr-defined]
        self.app.switch_mode("chat")

    def action_export(self) -> None:
        """The export dialog for the selected run (mlxtoy export's choices, with progress)."""
        if self.selected is None:
            return
        self.app.push_screen(ExportScreen(self.selected.run_dir))

    def action_serve(self) -> None:
        """Serve the selected run (`mlxtoy serve`, in a child process); pressed again, stop it."""
        if self.server is not None:
            self.server.stop()
            self.notify("Stopping the server (requests in flight finish first).")
            self.server = None
            return
        if self.selected is None:
            return
        run = self.selected
        self.server = ServeProcess(serve_argv(run.run_dir, run.method))
        self.run_worker(self._start_server(self.server, os.path.basename(os.path.normpath(run.run_dir))),
                        group="serve", exit_on_error=False)

    async def _start_server(self, server: ServeProcess, name: str) -> None:
        self.notify(f"Starting a server for {name}...")
        try:
            url = await server.start()
        except (OSError, RuntimeError) as e:
            if self.server is server:
                self.server = None
            self.notify(f"Could not serve {name}: {e}", severity="error")
            return
        self.notify(f"Serving {name} on {url}/v1 (model \"{name}\"); press v again to stop.", timeout=30)

    def on_unmount(self) -> None:
        if self.server is not None:
            self.server.stop()
