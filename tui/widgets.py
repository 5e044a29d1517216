"""Widgets shared by the screens: the nav bar, the loss chart, the taps heat map, stats, a file picker."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable

from rich.console import RenderableType
from rich.markup import escape
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Button, DirectoryTree, Input, Label, Static
from textual_plotext import PlotextPlot

from mlxtoy.events import Metric
from tui.state import DONE, FAILED, PAUSED, RUNNING, STARTING, STOPPING, RunState, Series

SCREENS = (("setup", "F1", "Setup"), ("train", "F2", "Train"), ("chat", "F3", "Chat"), ("runs", "F4", "Runs"))

# Textual content markup with theme variables, so both the dark and the light theme read well
STATUS_STYLE = {RUNNING: "bold $success", PAUSED: "bold $warning", STARTING: "bold $accent",
                STOPPING: "bold $warning", DONE: "bold $primary", FAILED: "bold $error"}


class NavBar(Static):
    """One line: the screens (clickable, with their F-keys) and the training status."""

    DEFAULT_CSS = """
    NavBar { height: 1; background: $panel; color: $text; link-style: none;
             link-color: $text; link-background-hover: $accent 40%; }
    """

    def __init__(self, current: str, **kw) -> None:
        super().__init__(**kw)
        self.current = current
        self._shown = ""

    def on_mount(self) -> None:
        self.update_status()
        self.set_interval(0.5, self.update_status)

    def update_status(self) -> None:
        state: RunState = self.app.run_state  # type: ignore[attr-defined]
        parts = [" [b]mlxtoy[/b] "]
        for mode, key, label in SCREENS:
            if mode == self.current:
                parts.append(f"[reverse] {key} {label} [/reverse]")
            else:
                parts.append(f"[@click=app.switch_mode('{mode}')] {key} {label} [/]")
        status = state.status
        style = STATUS_STYLE.get(status, "$text-muted")
        right = f"[{style}]● {status}[/]"
        if state.steps or state.total_steps:
            right += f" {state.step}/{state.total_steps or '?'}"
        text = "".join(parts) + "  " + right
        if text != self._shown:  # re-render only on change: four screens run this timer
            self._shown = text
            self.update(text)


class StatsPanel(Static):
    """Status, step, the objective's headline (the loss; GRPO's reward) and values, lr, tokens/s,
    ETA, memory of the run, two compact lines."""

    DEFAULT_CSS = """
    StatsPanel { height: auto; padding: 0 1; }
    """

    _shown = ""

    def show(self, state: RunState) -> None:
        s = state.summary()
        style = STATUS_STYLE.get(state.status, "bold")

        def item(label: str, value: str, value_style: str = "bold") -> str:
            return f"[$text-muted]{label}[/] [{value_style}]{escape(value)}[/]"

        # what the objective declares: its headline and held-out headline, then its other values
        step_metrics, eval_metrics = state.metrics
        line1 = ([item("status", s["status"], style), item("step", s["step"])]
                 + [item(m.label, s[m.label]) for m in (step_metrics[0], eval_metrics[0])] + [item("lr", s["lr"])]
                 + [item(m.label, s[m.label]) for m in step_metrics[1:]])
        line2 = [item("tok/s", s["tok/s"]), item("eta", s["eta"]), item("elapsed", s["elapsed"]),
                 item("mem", s["mem"])]
        if state.run_dir:
            line2.append(item("run", _shorten(state.run_dir, 40), "$text"))
        text = "  ".join(line1) + "\n" + "  ".join(line2)
        if text != self._shown:
            self._shown = text
            self.update(text)


def _shorten(path: str, n: int) -> str:
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    return path if len(path) <= n else "…" + path[-(n - 1):]


TRAIN_RGB = (0, 135, 255)  # readable on the dark and the light theme
VALID_RGB = (230, 120, 0)
LEGEND = "{label}  [#0087ff]━ train[/]  [#e67800]● valid[/]"


class LossChart(PlotextPlot):
    """Training loss (line) and validation loss (points) against the step."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.val_steps: list[int] = []
        self.val_losses: list[float] = []
        self.label = "loss"

    def set_series(self, steps, losses, val_steps, val_losses, label: str = "loss") -> None:
        """The series to plot: the loss, or a run's headline (`label`: what it is)."""
        self.steps, self.losses = list(steps), list(losses)
        self.val_steps, self.val_losses = list(val_steps), list(val_losses)
        self.label = label
        if self.is_mounted:
            self.border_title = LEGEND.format(label=label)
        self.replot()

    def on_mount(self) -> None:
        super().on_mount()
        self.border_title = LEGEND.format(label=self.label)
        self.replot()

    def replot(self) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        if self.size.height >= 12:
            plt.xlabel("step")
        # non-finite values (a diverged step) would break the axis scaling
        pts = [(s, v) for s, v in zip(self.steps, self.losses) if math.isfinite(v)]
        vpts = [(s, v) for s, v in zip(self.val_steps, self.val_losses) if math.isfinite(v)]
        pts = _decimate(pts, MAX_POINTS)
        # no plotext legend: it covers the start of the curve; the border title is the legend
        if pts:
            plt.plot([p[0] for p in pts], [p[1] for p in pts], marker="braille", color=TRAIN_RGB)
        if vpts:
            plt.scatter([p[0] for p in vpts], [p[1] for p in vpts], marker="●", color=VALID_RGB)
        if not pts and not vpts:
            plt.title("loss: waiting for the first step")
        else:
            xs = [p[0] for p in pts + vpts]
            ticks = nice_ticks(min(xs), max(xs))  # whole steps, not plotext's 34.2
            plt.xticks(ticks, [str(t) for t in ticks])
        self.refresh()


METRIC_RGB = ((0, 160, 80), (150, 80, 200), (200, 60, 60), (0, 150, 160))  # after TRAIN_RGB


class MetricsChart(PlotextPlot):
    """The objective's other declared values beside the headline chart (DPO / ORPO: the reward
    margin and the pair accuracy; GRPO: the loss and the completions' length): each step
    metric a line, each eval metric points, against the step. What it plots is the
    objective's declaration (`Metric.chart`), never a test of the run's fields."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._lines: list[tuple[str, Series]] = []
        self._points: list[tuple[str, Series]] = []

    @staticmethod
    def charted(state: RunState) -> tuple[list[Metric], list[Metric]]:
        """(step metrics, eval metrics) it plots: the declared ones after the headlines."""
        step_metrics, eval_metrics = state.metrics
        return [m for m in step_metrics[1:] if m.chart], [m for m in eval_metrics[1:] if m.chart]

    def show(self, state: RunState) -> None:
        lines, points = self.charted(state)
        self._lines = [(m.label, state.series(m)) for m in lines]
        self._points = [(m.label, state.series(m, of_eval=True)) for m in points]
        if self.is_mounted:
            self.border_title = self.legend()
        self.replot()

    def legend(self) -> str:
        parts = [f"[{_hex(_color(i))}]━ {escape(label)}[/]" for i, (label, _) in enumerate(self._lines)]
        parts += [f"[{_hex(VALID_RGB)}]● {escape(label)}[/]" for label, _ in self._points]
        return "  ".join(parts)

    def on_mount(self) -> None:
        super().on_mount()
        self.border_title = self.legend()
        self.replot()

    def replot(self) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        xs: list[int] = []
        for i, (_, series) in enumerate(self._lines):
            pts = _decimate([(s, v) for s, v in zip(series.steps, series.values) if math.isfinite(v)], MAX_POINTS)
            if pts:
                plt.plot([p[0] for p in pts], [p[1] for p in pts], marker="braille", color=_color(i))
                xs += [p[0] for p in pts]
        for _, series in self._points:
            if series.steps:
                plt.scatter(series.steps, series.values, marker="●", color=VALID_RGB)
                xs += series.steps
        if not xs:
            plt.title("waiting for the first step")
        else:
            ticks = nice_ticks(min(xs), max(xs))
            plt.xticks(ticks, [str(t) for t in ticks])
        self.refresh()


def _color(i: int) -> tuple[int, int, int]:
    return (TRAIN_RGB, *METRIC_RGB)[i % (1 + len(METRIC_RGB))]


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#" + "".join(f"{c:02x}" for c in rgb)


def nice_ticks(lo: int, hi: int, most: int = 7) -> list[int]:
    """Whole step numbers for the x axis: lo, then multiples of 1, 2 or 5 x 10^k up to hi."""
    span = max(1, hi - lo)
    step = 1
    while span / step > most - 1:
        lead = str(step)[0]  # 1 -> 2 -> 5 -> 10 -> 20 -> 50 ...
        step = step * 5 // 2 if lead == "2" else step * 2
    multiples = [t for t in range(-(-lo // step) * step, hi + 1, step) if t - lo >= step / 2]
    return [lo] + multiples


MAX_POINTS = 600  # plotext's cost grows with the points; a long run is averaged into buckets


def _decimate(pts: list[tuple[int, float]], limit: int) -> list[tuple[int, float]]:
    """At most `limit` points: consecutive buckets averaged (the curve's shape is kept)."""
    if len(pts) <= limit:
        return pts
    size = -(-len(pts) // limit)
    out = []
    for i in range(0, len(pts), size):
        chunk = pts[i:i + size]
        out.append((chunk[-1][0], sum(v for _, v in chunk) / len(chunk)))
    return out


# colour ramp for the heat map: readable on dark and light backgrounds
RAMP = ["#2c1e5c", "#3b4d9a", "#2e7fb8", "#1fa187", "#5ec962", "#b5de2b", "#fde725", "#f8961e", "#e3342f"]


class TapsHeatmap(Widget):
    """Layers (columns) x tap sites (rows), each cell coloured by the RMS of that activation.

    Colours are scaled per site on a log scale (the residual stream grows with depth, so one
    global scale would flatten the other sites); each row ends with its range.
    """

    DEFAULT_CSS = """
    TapsHeatmap { height: auto; min-height: 1; padding: 0 1; }
    """

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.state: RunState | None = None
        self._rows = -1

    def show(self, state: RunState) -> None:
        self.state = state
        n_layers, sites, _ = state.taps_grid()
        title = (f"taps: rms per layer, step {state.taps.step if state.taps else '?'}, {n_layers} layers"
                 if n_layers else "taps")
        if title != self.border_title:
            self.border_title = title
        # a layout pass costs the whole screen: only when the number of rows changes
        self.refresh(layout=len(sites) != self._rows)
        self._rows = len(sites)

    def get_content_height(self, container, viewport, width: int) -> int:
        n_layers, sites, _ = self.state.taps_grid() if self.state else (0, [], {})
        return max(1, len(sites) + 1)

    def render(self) -> RenderableType:
        state = self.state
        n_layers, sites, values = state.taps_grid() if state else (0, [], {})
        if not n_layers:
            return Text("taps: none yet (set 'taps every' > 0 in Setup)", style="dim")
        label_w = max(len(s) for s in sites) + 1
        legend_w = 14
        width = max(20, self.size.width - 2)
        cell = max(1, min(4, (width - label_w - legend_w) // n_layers))
        shown = min(n_layers, max(1, (width - label_w - legend_w) // cell))
        t = Text()
        for site in sites:
            row = [values.get((layer, site)) for layer in range(shown)]
            finite = [v for v in row if v is not None and v > 0 and math.isfinite(v)]
            lo, hi = (min(finite), max(finite)) if finite else (1.0, 1.0)
            t.append(site.ljust(label_w), style="bold")
            for v in row:
                if v is None or not math.isfinite(v):
                    t.append("·" * cell, style="dim")
                    continue
                t.append("█" * cell, style=Style(color=_ramp(v, lo, hi)))
            t.append(f" {_num(lo)}–{_num(hi)}", style="dim")
            t.append("\n")
        # a layer axis: a tick every 5 layers
        axis = [" "] * (shown * cell)
        for layer in range(0, shown, 5 if cell < 3 else 2):
            label = str(layer)
            pos = layer * cell
            if pos + len(label) <= len(axis):
                axis[pos:pos + len(label)] = list(label)
        t.append(" " * label_w + "".join(axis) + (" layer" if shown == n_layers else
                                                   f" layers 0-{shown - 1} of {n_layers}"), style="dim")
        return t


def _ramp(v: float, lo: float, hi: float) -> str:
    if hi <= lo or v <= 0:
        return RAMP[len(RAMP) // 2]
    x = (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return RAMP[min(len(RAMP) - 1, max(0, int(x * (len(RAMP) - 1) + 0.5)))]


def _num(v: float) -> str:
    return f"{v:.2g}" if v < 100 else f"{v:.0f}"


class FilteredTree(DirectoryTree):
    """Folders and the files whose names end with one of `suffixes`; no hidden entries."""

    def __init__(self, path: str, suffixes: tuple[str, ...], **kw) -> None:
        self.suffixes = suffixes
        super().__init__(path, **kw)

    def filter_paths(self, paths: Iterable[Path]) -> Iterable[Path]:
        out = []
        for p in paths:
            if p.name.startswith(".") or p.name == "__pycache__":
                continue
            try:
                if p.is_dir() or not self.suffixes or p.name.endswith(self.suffixes):
                    out.append(p)
            except OSError:
                continue
        return out


class FilePicker(ModalScreen[str | None]):
    """Pick a file (or, with folders=True, a folder) from a tree; Enter on a file picks it."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+u", "up", "Parent folder")]

    def __init__(self, title: str, start: str, suffixes: tuple[str, ...], folders: bool = False) -> None:
        super().__init__()
        self.title_text = title
        self.suffixes = suffixes
        self.folders = folders
        start = os.path.abspath(os.path.expanduser(start or "."))
        while start and not os.path.isdir(start):
            start = os.path.dirname(start)
        start = start or os.getcwd()
        rel = os.path.relpath(start)
        self.start = rel if not rel.startswith("..") else start  # short and stable when under cwd
        self.highlighted: str | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="picker"):
            yield Label(f"[b]{self.title_text}[/b]  [dim](Enter picks a file, ctrl+u goes up, Esc cancels)[/dim]")
            yield Input(self.start, id="picker-root", placeholder="folder to browse", compact=True)
            yield FilteredTree(self.start, self.suffixes, id="picker-tree")
            with Horizontal(id="picker-buttons"):
                if self.folders:
                    yield Button("Use folder", id="picker-folder", compact=True)
                yield Button("Cancel", id="picker-cancel", compact=True)

    def on_mount(self) -> None:
        self.query_one(FilteredTree).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        path = os.path.abspath(os.path.expanduser(event.value))
        if os.path.isdir(path):
            self.query_one(FilteredTree).path = path
            self.query_one(FilteredTree).focus()
        elif os.path.isfile(path):
            self.dismiss(path)
        else:
            self.notify(f"{path}: no such folder", severity="error")

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        self.dismiss(str(event.path))

    def on_tree_node_highlighted(self, event) -> None:
        data = getattr(event.node, "data", None)
        if data is not None:
            self.highlighted = str(data.path)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "picker-folder":
            path = self.highlighted or str(self.query_one(FilteredTree).path)
            self.dismiss(path if os.path.isdir(path) else os.path.dirname(path))
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_up(self) -> None:
        tree = self.query_one(FilteredTree)
        parent = os.path.dirname(str(tree.path).rstrip("/")) or "/"
        tree.path = parent
        self.query_one("#picker-root", Input).value = parent
