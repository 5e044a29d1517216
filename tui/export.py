"""Export a run from the Runs screen: the choices of `mlxtoy export` (format: a merged GGUF, a
LoRA adapter GGUF, HF, mlx-lm or PEFT; its types; the output path), checked before anything
loads, then the export itself on the MLX thread with its progress. The writing is mlxtoy.export's
(the same code as the CLI's); this dialog only collects the choices and shows what happens."""

from __future__ import annotations

import os

from rich.markup import escape
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, ProgressBar, Select, Static

from mlxtoy import backend
from mlxtoy.errors import UserError
from mlxtoy.export import FILE_FORMATS, FORMAT_HELP, check_format, check_output, dtypes_for, export_source, load_source


def default_output(run_dir: str, fmt: str, dtype: str) -> str:
    """Where an export of `run_dir` goes unless the user says otherwise: beside the run, named
    after it, the format and the type (a .gguf file, or a folder for hf / mlx-lm / peft)."""
    run_dir = os.path.normpath(run_dir)
    name = f"{os.path.basename(run_dir)}-{fmt}-{dtype}"
    return os.path.join(os.path.dirname(run_dir), name + (".gguf" if fmt in FILE_FORMATS else ""))


def export_size(path: str) -> int:
    """Bytes written: the file, or every file under the folder."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


class ExportScreen(ModalScreen):
    """The export dialog for one run; dismissed with the written path (None when cancelled)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "start", "Export", priority=True)]
    DEFAULT_CSS = """
    ExportScreen { align: center middle; }
    #export-dialog { width: 90; height: auto; padding: 1 2; border: thick $accent; background: $surface; }
    #export-dialog .row { height: 1; margin-bottom: 1; }
    #export-help, #export-status { height: auto; margin-bottom: 1; }
    #export-progress { margin-bottom: 1; }
    """

    def __init__(self, run_dir: str, **kw) -> None:
        super().__init__(**kw)
        self.run_dir = run_dir
        self.exporting = False
        self.error: str | None = None  # why the last try did not export (shown in the dialog)
        self._suggested = default_output(run_dir, "gguf", "f16")  # the path while the user has not typed one

    def compose(self) -> ComposeResult:
        with Vertical(id="export-dialog"):
            yield Static(f"[b]Export[/b] {escape(self.run_dir)}")
            with Horizontal(classes="row"):
                yield Label("format", classes="flabel")
                yield Select([(f"{fmt}: {text}", fmt) for fmt, text in FORMAT_HELP.items()], value="gguf",
                             allow_blank=False, compact=True, id="export-format")
            with Horizontal(classes="row"):
                yield Label("type", classes="flabel")
                yield Select([(d, d) for d in dtypes_for("gguf")], value="f16", allow_blank=False, compact=True,
                             id="export-dtype")
            with Horizontal(classes="row"):
                yield Label("output", classes="flabel")
                yield Input(self._suggested, compact=True, id="export-out")
            yield Static("", id="export-help")
            yield ProgressBar(total=None, show_eta=False, id="export-progress")
            yield Static("[dim]ctrl+s exports, Esc closes[/dim]", id="export-status")
            yield Button("Export (ctrl+s)", id="export-start", compact=True)

    def on_mount(self) -> None:
        self._describe()

    @property
    def choice(self) -> tuple[str, str, str]:
        """(format, type, output path) as the dialog holds them."""
        fmt = str(self.query_one("#export-format", Select).value)
        dtype = str(self.query_one("#export-dtype", Select).value)
        return fmt, dtype, self.query_one("#export-out", Input).value.strip()

    def _describe(self) -> None:
        fmt, dtype, _ = self.choice
        what = ("the whole model (a run's adapters merged into its base)" if fmt in ("gguf", "hf")
                else "the run's adapters alone (applied on the base model)")
        self.query_one("#export-help", Static).update(f"[dim]writes {what}, in {dtype}[/dim]")

    @on(Select.Changed, "#export-format")
    def _format_changed(self) -> None:
        fmt = str(self.query_one("#export-format", Select).value)
        types = self.query_one("#export-dtype", Select)
        keep = str(types.value)
        allowed = dtypes_for(fmt)
        types.set_options([(d, d) for d in allowed])
        types.value = keep if keep in allowed else "f32"
        self._follow_suggestion()

    @on(Select.Changed, "#export-dtype")
    def _dtype_changed(self) -> None:
        self._follow_suggestion()

    def _follow_suggestion(self) -> None:
        """Keep the suggested output path in step with the choices until the user types one."""
        out = self.query_one("#export-out", Input)
        if out.value.strip() == self._suggested:
            fmt, dtype, _ = self.choice
            self._suggested = default_output(self.run_dir, fmt, dtype)
            out.value = self._suggested
        self._describe()

    def action_cancel(self) -> None:
        if self.exporting:
            self.notify("The export finishes first (it writes atomically).", severity="warning")
            return
        self.dismiss(None)

    @on(Button.Pressed, "#export-start")
    def action_start(self) -> None:
        if self.exporting:
            return
        fmt, dtype, out = self.choice
        try:  # the CLI's checks, before anything loads
            if not out:
                raise UserError("give an output path")
            check_format(fmt, dtype)
            check_output(out, fmt)
        except UserError as e:
            self.error = str(e)
            self._status(f"[red]{escape(self.error)}[/red]")
            return
        self.error = None
        self.exporting = True
        for widget in self.query("Select, Input, Button"):
            widget.disabled = True
        self._status(f"loading {escape(self.run_dir)} ...")
        self._export(fmt, dtype, out)

    @work(exclusive=True, group="export")
    async def _export(self, fmt: str, dtype: str, out: str) -> None:
        app = self.app

        def progress(done: int, total: int) -> None:  # on the MLX thread
            app.call_from_thread(self._progress, done, total)

        def run() -> str:
            src = load_source(self.run_dir, fmt=fmt)
            app.call_from_thread(self._status, f"writing {escape(out)} ...")
            with backend.wired_limit(src.weights, warn=None):  # as `mlxtoy export`
                return export_source(src, out, fmt, dtype, progress)

        try:
            path = await app.mlx.run(run)  # type: ignore[attr-defined]
        except UserError as e:
            self._failed(str(e))
            return
        except Exception as e:  # shown, not raised: the app keeps running
            self._failed(f"{type(e).__name__}: {e}")
            return
        size = export_size(path)
        app.notify(f"exported {path} ({fmt}, {dtype}, {size / 1e6:.1f} MB)", timeout=10)
        self.exporting = False
        self.dismiss(path)

    def _progress(self, done: int, total: int) -> None:
        self.query_one("#export-progress", ProgressBar).update(total=total, progress=done)

    def _status(self, text: str) -> None:
        self.query_one("#export-status", Static).update(text)

    def _failed(self, message: str) -> None:
        self.error = message
        self.exporting = False
        for widget in self.query("Select, Input, Button"):
            widget.disabled = False
        self._status(f"[red]export failed: {escape(message)}[/red]")
