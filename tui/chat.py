"""Generate / chat: stream tokens from the base model, a run's weights, or one of its checkpoints.

While a run trains, "current run" first asks the trainer for a checkpoint and loads that, so
you can talk to the weights of a paused (or running) run without touching the trainer.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from rich.markup import escape
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Checkbox, Footer, Input, Label, Select, Static

from mlxtoy.rundir import RunDir, is_checkpoint
from tui.generation import Source
from tui.state import RunState, scan_runs
from tui.widgets import NavBar

CURRENT = "@current"


def parse_sampling(temp: str, top_p: str, max_tokens: str) -> tuple[dict[str, Any], dict[str, str]]:
    """-> (params, errors by field)."""
    params: dict[str, Any] = {}
    errors: dict[str, str] = {}
    try:
        params["temp"] = float(temp)
        if not params["temp"] >= 0:
            errors["temp"] = "temperature must be >= 0 (0 = greedy)"
    except ValueError:
        errors["temp"] = f"temperature {temp!r} is not a number"
    try:
        params["top_p"] = float(top_p)
        if not 0 < params["top_p"] <= 1:
            errors["top_p"] = "top-p must be in (0, 1]"
    except ValueError:
        errors["top_p"] = f"top-p {top_p!r} is not a number"
    try:
        params["max_tokens"] = int(max_tokens)
        if params["max_tokens"] <= 0:
            errors["max_tokens"] = "max tokens must be > 0"
    except ValueError:
        errors["max_tokens"] = f"max tokens {max_tokens!r} is not a whole number"
    return params, errors


class ChatScreen(Screen):
    BINDINGS = [
        Binding("ctrl+l", "load", "Load model"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("escape", "stop_generation", "Stop"),
    ]

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.sources: dict[str, Source] = {}
        self.loaded: Source | None = None
        self.generating = False
        self._reply: Static | None = None
        self._reply_text = ""

    @property
    def cancel(self) -> threading.Event:
        return self.app.gen_cancel  # type: ignore[attr-defined]

    def compose(self) -> ComposeResult:
        yield NavBar("chat")
        with Vertical(id="chat"):
            with Horizontal(classes="row"):
                yield Label("source", classes="flabel")
                yield Select([], id="source", compact=True, allow_blank=True, prompt="choose weights")
                yield Button("Load", id="load", compact=True)
            with Horizontal(classes="row", id="sampling"):
                yield Label("temp", classes="slabel")
                yield Input("0.7", id="temp", compact=True)
                yield Label("top-p", classes="slabel")
                yield Input("0.95", id="top_p", compact=True)
                yield Label("max", classes="slabel")
                yield Input("128", id="max_tokens", compact=True)
                yield Checkbox("chat template", True, id="chat-mode", compact=True)
            yield Static("", id="chat-error", classes="ferror")
            yield Static("[dim]No model loaded: choose a source and press ctrl+l.[/dim]", id="chat-status")
            yield VerticalScroll(id="transcript")
            yield Input(placeholder="Type a message and press Enter (Esc stops the reply)", id="prompt", compact=True)
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_sources()
        self.query_one("#chat-error").display = False
        self.query_one("#prompt", Input).focus()

    def on_screen_resume(self) -> None:
        self.refresh_sources()

    # ---------------------------------------------------------------- sources

    def refresh_sources(self) -> None:
        app = self.app
        state: RunState = app.run_state  # type: ignore[attr-defined]
        base = app.current_model()  # type: ignore[attr-defined]
        sources: dict[str, Source] = {f"base:{base}": Source(f"base model {base}", base)}
        if state.run_dir:
            run_model = state.config.get("model") or base
            name = os.path.basename(state.run_dir.rstrip("/"))
            sources[CURRENT] = Source(f"current run {name} (latest weights)", run_model, state.run_dir)
            run = RunDir(state.run_dir)
            if is_checkpoint(run.best_path):
                sources[f"ckpt:{run.best_path}"] = Source(f"{name} best (lowest validation loss)", run_model,
                                                          run.best_path)
            for step, path in reversed(run.checkpoints()):
                sources[f"ckpt:{path}"] = Source(f"{name} checkpoint step {step}", run_model, path)
        for info in scan_runs(app.runs_dir)[:20]:  # type: ignore[attr-defined]
            if state.run_dir and os.path.abspath(info.path) == os.path.abspath(state.run_dir):
                continue
            model = RunDir(info.path).base_model() or base
            sources[f"run:{info.path}"] = Source(f"run {info.name} ({info.method}, {info.steps})", model, info.path)
        self.sources = sources
        select = self.query_one("#source", Select)
        current = select.value
        select.set_options([(s.label, k) for k, s in sources.items()])
        wanted = getattr(app, "chat_source_hint", None)
        if wanted and wanted in sources:
            select.value = wanted
            app.chat_source_hint = None  # type: ignore[attr-defined]
        elif current in sources:
            select.value = current
        elif CURRENT in sources:
            select.value = CURRENT
        else:
            select.value = next(iter(sources))

    # ---------------------------------------------------------------- loading

    @on(Button.Pressed, "#load")
    def _load_pressed(self) -> None:
        self.action_load()

    def action_load(self) -> None:
        key = self.query_one("#source", Select).value
        if key not in self.sources:
            self.notify("Choose a source first.", severity="warning")
            return
        self.load_source(key)

    @work(exclusive=True, group="load")
    async def load_source(self, key: str) -> None:
        app = self.app
        source = self.sources[key]
        status = self.query_one("#chat-status", Static)
        if key == CURRENT and app.trainer_alive:  # type: ignore[attr-defined]
            status.update("[cyan]asking the trainer for a checkpoint of the current weights…[/cyan]")
            path = await app.current_weights()  # type: ignore[attr-defined]
            if not path:
                status.update("[red]the trainer wrote no checkpoint; try again when it is running[/red]")
                return
            source = Source(f"{source.label.split(' (')[0]} at {os.path.basename(path)}", source.model, path)
        status.update(f"[cyan]loading {escape(source.label)}…[/cyan]")
        try:
            desc = await app.mlx.run(app.generator.load, source)  # type: ignore[attr-defined]
        except Exception as e:  # UserError and anything else: say it, keep the app up
            status.update(f"[red]✗ could not load {escape(source.label)}: {escape(str(e))}[/red]")
            return
        self.loaded = source
        mode = "chat template" if app.generator.has_chat_template else "no chat template: plain completion"  # type: ignore[attr-defined]
        status.update(f"[green]✓[/green] {escape(desc)} [dim]({mode})[/dim]")
        self.query_one("#prompt", Input).focus()

    # ---------------------------------------------------------------- generating

    @on(Input.Changed, "#temp, #top_p, #max_tokens")
    def _sampling_changed(self) -> None:
        self._sampling()

    def _sampling(self) -> dict[str, Any] | None:
        params, errors = parse_sampling(self.query_one("#temp", Input).value,
                                        self.query_one("#top_p", Input).value,
                                        self.query_one("#max_tokens", Input).value)
        err = self.query_one("#chat-error", Static)
        for name in ("temp", "top_p", "max_tokens"):
            self.query_one(f"#{name}", Input).set_class(name in errors, "-bad")
        if errors:
            err.update("✗ " + escape("; ".join(errors.values())))
            err.display = True
            return None
        err.display = False
        return params

    @on(Input.Submitted, "#prompt")
    def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.generating:
            self.notify("Still replying: Esc stops it.", severity="warning")
            return
        if self.loaded is None:
            self.notify("Load a model first (ctrl+l).", severity="warning")
            return
        params = self._sampling()
        if params is None:
            return
        event.input.value = ""
        self.run_generation(text, params, self.query_one("#chat-mode", Checkbox).value)

    @work(exclusive=True, group="generate")
    async def run_generation(self, text: str, params: dict[str, Any], chat: bool) -> None:
        app = self.app
        transcript = self.query_one("#transcript", VerticalScroll)
        await transcript.mount(Static(f"[b]you[/b] {escape(text)}", classes="msg user"))
        self._reply_text = ""
        self._reply = Static("[b]model[/b] [dim]…[/dim]", classes="msg model")
        await transcript.mount(self._reply)
        transcript.scroll_end(animate=False)
        loop = asyncio.get_running_loop()
        self.cancel.clear()
        self.generating = True
        status = self.query_one("#chat-status", Static)
        try:
            stats = await app.mlx.run(app.generator.generate, text, chat, params,  # type: ignore[attr-defined]
                                      lambda t: loop.call_soon_threadsafe(self._append, t), self.cancel)
            await asyncio.sleep(0)  # let the last call_soon_threadsafe callbacks run
            status.update(f"[dim]{escape(stats)}[/dim]")
        except Exception as e:
            status.update(f"[red]✗ generation failed: {escape(str(e))}[/red]")
        finally:
            self.generating = False

    def _append(self, text: str) -> None:
        self._reply_text += text
        if self._reply is not None:
            self._reply.update(f"[b]model[/b] {escape(self._reply_text)}")
            self.query_one("#transcript", VerticalScroll).scroll_end(animate=False)

    def action_stop_generation(self) -> None:
        if self.generating:
            self.cancel.set()

    async def action_new_chat(self) -> None:
        self.cancel.set()
        self.app.generator.reset()  # type: ignore[attr-defined]
        await self.query_one("#transcript", VerticalScroll).remove_children()
        self.query_one("#prompt", Input).focus()
