"""Setup: choose the model and the data, the method and hyper-parameters, then Start.

Every field is checked as it is typed; a bad value shows its reason under the field and Start
refuses until all are good. The data preview (first examples, count, token lengths) is built in
a worker thread so a large file never blocks typing.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from rich.markup import escape
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Input, Label, Select, Static

from mlxtoy import backend, settings
from mlxtoy.config import BETA, TrainConfig, field_default, parse_text, train_field
from mlxtoy.errors import UserError
from mlxtoy.io.hub import parse_id
from mlxtoy.io.registry import BUILTIN, resolve_model
from mlxtoy.io.tables import dataset_id, is_table_file
from mlxtoy.loading import load_tokenizer
from mlxtoy.rundir import is_run
from mlxtoy.train.formats import Renderer, as_trained, with_template_kwargs
from mlxtoy.train.objectives import make_objective
from mlxtoy.train.records import read_data
from mlxtoy.train.rewards import BUILTINS
from tui.widgets import FilePicker, NavBar

@dataclass(frozen=True)
class Field:
    """One form field: a TrainConfig field, with its label, methods and check from its metadata."""

    name: str

    @property
    def label(self) -> str:
        return train_field(self.name).metadata.get("label") or self.name.replace("_", " ")

    @property
    def methods(self) -> tuple[str, ...]:
        return train_field(self.name).metadata["methods"]

    @property
    def objectives(self) -> tuple[str, ...]:
        return train_field(self.name).metadata["objectives"]

    def applies(self, method: str, objective: str) -> bool:
        return method in self.methods and objective in self.objectives


FIELDS = tuple(Field(name) for name in (
    "steps", "batch_size", "seq_len", "lr", "beta", "reward", "group_size", "max_completion_tokens",
    "lora_rank", "lora_alpha", "lora_targets", "d_model", "n_layers", "n_heads", "eval_every", "eval_batches",
    "save_every", "sample_every", "taps_every", "chat_template_kwargs"))
# what the reward field offers (a FILE.py:FUNCTION of one's own goes there too)
REWARD_HINT = "built-ins: " + ", ".join(BUILTINS) + "; or FILE.py:FUNCTION"


def beta_default(objective: str) -> float:
    """What --beta is when not given, for this objective (0.1 for DPO / ORPO, 0 for GRPO)."""
    return BETA[objective][0]


# The form starts from TrainConfig's defaults, except that samples and taps are on so the
# dashboard has something to show (the CLI keeps them off: they cost time), and beta shows the
# default objective's value.
UI_OVERRIDES: dict[str, Any] = {"sample_every": 50, "taps_every": 10, "beta": beta_default(field_default("objective"))}
DEFAULTS: dict[str, Any] = {f.name: UI_OVERRIDES.get(f.name, field_default(f.name)) for f in FIELDS}


def parse_value(name: str, text: str) -> tuple[Any, str | None]:
    """-> (value, None) or (None, reason) for the form's field `name`. Never raises."""
    return parse_text(name, text)


def check_model(value: str) -> tuple[str | None, str]:
    """-> (error or None, a short description)."""
    value = value.strip()
    if not value:
        return "choose a model: a built-in name, a .gguf file or a Hugging Face folder", ""
    if value in BUILTIN:
        return None, f"built-in: {BUILTIN[value].filename}"
    path = os.path.expanduser(value)
    if not os.path.exists(path):
        if parse_id(value) is not None:  # what resolve_model would fetch from the Hub
            return None, "Hugging Face id: Enter fetches it now (else it is fetched when first used)"
        return (f"{value}: no such file or folder (built-in: {', '.join(BUILTIN)}; or a Hugging Face "
                f"id, org/name)"), ""
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            return f"{value}: a folder without config.json (not a Hugging Face model)", ""
        return None, "Hugging Face folder"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"{value}: cannot read ({e.strerror})", ""
    if magic != b"GGUF":
        return f"{value}: not a GGUF file", ""
    return None, f"GGUF, {os.path.getsize(path) / 1e6:.0f} MB"


# where the trainer computes: MLXTOY_DEVICE's choices (the CLI's --device), or the GPU where there is one
DEVICES = (("auto", "auto"),) + tuple((c, c) for c in settings.DEVICE.choices or ())


def check_device(value: str) -> str | None:
    if value == "gpu" and backend.gpu_name() is None:
        return "no GPU here (this MLX finds neither Metal nor CUDA); choose cpu or auto"
    return None


def check_data_path(value: str) -> str | None:
    value = value.strip()
    if not value:
        return "choose the training data (.jsonl, .txt, .parquet, .csv, .arrow, a folder or a dataset id)"
    path = os.path.expanduser(value)
    if not os.path.exists(path):
        if dataset_id(value) is not None and "." not in os.path.basename(value):
            return None  # a Hugging Face dataset id: the preview fetches and reads it
        return f"{value}: no such file or folder"
    if os.path.isfile(path) and not (path.endswith((".jsonl", ".txt")) or is_table_file(path)):
        return f"{value}: use a .jsonl, .txt, .parquet, .csv or .arrow file"
    return None


def check_out(value: str) -> str | None:
    value = value.strip()
    if not value:
        return "name a folder for the run"
    path = os.path.expanduser(value)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{value}: exists and is not a folder"
    if is_run(path):
        return f"{value}: already holds a run; choose another folder"
    return None


def data_preview(data: str, model: str, seq_len: int | None, tokenizer_cache: dict,
                 template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse the data and measure token lengths (worker thread). Raises UserError on bad data.

    Every record goes through its format (mlxtoy.train.formats), as the trainer's batches do:
    "examples" are the first records' previews, "rendered" the first record's sequences as the
    trainer builds them ([(text, trained), ...] each: the chat template applied with the form's
    template kwargs, cut to seq_len + 1 tokens), "lengths" the longest sequence of each record."""
    raw = read_data(os.path.expanduser(data))
    records = raw.train
    out: dict[str, Any] = {"count": len(records), "kind": records[0].kind if records else "?",
                           "valid": len(raw.valid) if raw.valid is not None else None,
                           "test": len(raw.test), "examples": [], "rendered": [], "lengths": None,
                           "tokenizer_error": None}
    for rec in records[:3]:
        out["examples"].append(" ".join((f"[dim]{escape(label)}[/dim] " if label else "") + escape(text)
                                        for label, text in rec.format.preview(rec)))
    tok = tokenizer_cache.get(model)
    if tok is None and check_model(model)[0] is None:
        try:
            tok = tokenizer_cache[model] = load_tokenizer(model)
        except (UserError, OSError, ValueError) as e:
            out["tokenizer_error"] = str(e)
    if tok is not None:
        try:
            tok = with_template_kwargs(tok, template_kwargs or {})
        except UserError as e:
            out["tokenizer_error"] = str(e)
            tok = None
    if tok is not None:
        r = Renderer(tok)
        lengths = []
        for rec in records[:2000]:  # enough for the shape of the distribution
            try:
                sequences = rec.format.sequences(rec, r)
            except UserError as e:
                out["tokenizer_error"] = str(e)
                break
            if not out["rendered"]:
                out["rendered"] = [r.pieces(*as_trained(ids, loss, seq_len)) for ids, loss in sequences]
            lengths.append(max(len(ids) for ids, _ in sequences))  # a pair: the longer side
        if lengths:
            out["lengths"] = {"n": len(lengths), "min": min(lengths), "max": max(lengths),
                              "mean": sum(lengths) / len(lengths),
                              "over": sum(n > (seq_len or 1 << 30) + 1 for n in lengths),
                              "seq_len": seq_len}
    return out


def show_rendered(pieces: list[tuple[str, bool]], limit: int = 600) -> str:
    """A rendered sequence as markup: trained text green, the rest dim; at most `limit` characters."""
    out, left = [], limit
    for text, trained in pieces:
        if left <= 0:
            out.append("[dim]…[/dim]")
            break
        shown = escape(text[:left])
        out.append(f"[green]{shown}[/green]" if trained else f"[dim]{shown}[/dim]")
        left -= len(text)
    return "".join(out)


class SetupScreen(Screen):
    BINDINGS = [
        Binding("ctrl+s", "start", "Start", priority=True),
        Binding("ctrl+o", "browse('data')", "Open data"),
        Binding("ctrl+b", "browse('model')", "Browse model"),
    ]

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.errors: dict[str, str] = {}
        self.values: dict[str, Any] = {}
        self._tokenizers: dict[str, Any] = {}
        self.preview: dict[str, Any] | None = None

    def compose(self) -> ComposeResult:
        app = self.app
        yield NavBar("setup")
        with Horizontal(id="setup-body"):
            with VerticalScroll(id="form"):
                yield Label("[b]Model[/b]", classes="section")
                with Horizontal(classes="row"):
                    yield Label("model", classes="flabel")
                    yield Input(app.model_arg, id="f-model", compact=True,  # type: ignore[attr-defined]
                                placeholder="smollm2-135m, a .gguf file or an HF folder")
                    yield Button("…", id="browse-model", compact=True, tooltip="Pick a file (ctrl+b)")
                yield Static("", id="e-model", classes="ferror")
                with Horizontal(classes="row"):
                    yield Label("device", classes="flabel")
                    yield Select(DEVICES, value=settings.DEVICE.value() or "auto", allow_blank=False,
                                 id="f-device", compact=True, tooltip=settings.DEVICE.help)
                yield Static("", id="e-device", classes="ferror")
                with Horizontal(classes="row"):
                    yield Label("data", classes="flabel")
                    yield Input(app.data_arg or "", id="f-data", compact=True,  # type: ignore[attr-defined]
                                placeholder=".jsonl / .txt file or a folder")
                    yield Button("…", id="browse-data", compact=True, tooltip="Pick a file (ctrl+o)")
                yield Static("", id="e-data", classes="ferror")
                with Horizontal(classes="row"):
                    yield Label("method", classes="flabel")
                    yield Select([(m, m) for m in train_field("method").metadata["choices"]],
                                 value=field_default("method"), allow_blank=False, id="f-method", compact=True)
                with Horizontal(classes="row"):
                    yield Label("objective", classes="flabel")
                    yield Select([(o, o) for o in train_field("objective").metadata["choices"]],
                                 value=field_default("objective"), allow_blank=False, id="f-objective",
                                 compact=True)
                with Horizontal(classes="row"):
                    yield Label("run folder", classes="flabel")
                    yield Input(self._default_out(), id="f-out", compact=True,
                                placeholder="a new folder for the run")
                yield Static("", id="e-out", classes="ferror")
                yield Label("[b]Hyper-parameters[/b]", classes="section")
                for f in FIELDS:
                    with Horizontal(classes="row", id=f"row-{f.name}"):
                        yield Label(f.label, classes="flabel")
                        yield Input(_fmt(DEFAULTS[f.name]), id=f"f-{f.name}", compact=True,
                                    placeholder=REWARD_HINT if f.name == "reward" else "")
                    yield Static("", id=f"e-{f.name}", classes="ferror")
                yield Static("", id="form-error", classes="ferror")
                yield Button("Start training (ctrl+s)", id="start", variant="success", compact=True)
            with VerticalScroll(id="preview"):
                yield Static("", id="model-info")
                yield Static("[dim]Choose the training data to see a preview.[/dim]", id="data-info")
        yield Footer()

    def _default_out(self) -> str:
        return os.path.join(self.app.runs_dir, time.strftime("run-%Y%m%d-%H%M%S"))  # type: ignore[attr-defined]

    def on_mount(self) -> None:
        for f in FIELDS:
            self._check_field(f.name, self.query_one(f"#f-{f.name}", Input).value)
        self._check_model(self.query_one("#f-model", Input).value)
        self._check_out(self.query_one("#f-out", Input).value)
        self._set_error("device", check_device(self.device or ""))
        self._apply_method("lora")
        data = self.query_one("#f-data", Input).value
        if data:
            self._check_data(data)
        else:
            self._set_error("data", None)
        self.query_one("#f-data" if not data else "#f-steps", Input).focus()

    # ---------------------------------------------------------------- validation as you type

    def _set_error(self, name: str, message: str | None) -> None:
        label = self.query_one(f"#e-{name}", Static)
        if message:
            self.errors[name] = message
            label.update(f"✗ {escape(message)}")
            label.display = True
        else:
            self.errors.pop(name, None)
            label.update("")
            label.display = False
        try:
            self.query_one(f"#f-{name}").set_class(bool(message), "-bad")
        except Exception:
            pass

    def _check_field(self, name: str, text: str) -> None:
        f = next(f for f in FIELDS if f.name == name)
        value, err = parse_value(f.name, text)
        if err is None:
            self.values[name] = value
        # a field of another method or objective is hidden and not used: nothing to fix there
        self._set_error(name, err if f.applies(self._method(), self._objective()) else None)

    def _check_model(self, text: str) -> None:
        err, info = check_model(text)
        if not err and self._method() == "scratch":
            info += "; scratch: only its tokenizer is used"
        self._set_error("model", err)
        self.query_one("#model-info", Static).update(f"[b]Model[/b] {escape(text)}  [dim]{escape(info)}[/dim]"
                                                     if not err else "")

    def _check_out(self, text: str) -> None:
        self._set_error("out", check_out(text))

    def _check_data(self, text: str) -> None:
        err = check_data_path(text)
        self._set_error("data", err)
        info = self.query_one("#data-info", Static)
        if err:
            self.preview = None
            info.update(f"[red]{escape(err)}[/red]")
            return
        info.update("[dim]reading the data…[/dim]")
        self._set_error("data", None)
        self.errors["data"] = "still reading the data"  # Start waits for the preview
        self.load_preview(text, self.query_one("#f-model", Input).value.strip(), self.values.get("seq_len"),
                          self.values.get("chat_template_kwargs"))

    @work(thread=True, exclusive=True, group="preview")
    def load_preview(self, data: str, model: str, seq_len: int | None, template_kwargs: dict | None) -> None:
        try:
            result = data_preview(data, model, seq_len, self._tokenizers, template_kwargs)
            error = None
        except UserError as e:
            result, error = None, str(e)
        except Exception as e:  # a preview must never take the app down
            result, error = None, f"{type(e).__name__}: {e}"
        self.app.call_from_thread(self._show_preview, data, result, error)

    def _show_preview(self, data: str, result: dict[str, Any] | None, error: str | None) -> None:
        if self.query_one("#f-data", Input).value != data:
            return  # typed on since; a newer preview is coming
        info = self.query_one("#data-info", Static)
        self.preview = result
        if error:
            self._set_error("data", error)
            info.update(f"[b]Data[/b]\n[red]✗ {escape(error)}[/red]")
            return
        self._set_error("data", None)
        assert result is not None
        lines = [f"[b]Data[/b] {result['count']} examples ({result['kind']})"]
        if result["valid"] is not None:
            lines.append(f"validation file: {result['valid']} examples")
        if result["test"]:
            lines.append(f"test file: {result['test']} examples")
        n = result["lengths"]
        if n:
            lines.append(f"tokens per example: min {n['min']}, mean {n['mean']:.0f}, max {n['max']}"
                         + (f" (first {n['n']})" if n["n"] < result["count"] else ""))
            if n["over"]:
                lines.append(f"[yellow]{n['over']} longer than seq len {n['seq_len']} (truncated)[/yellow]")
        elif result["tokenizer_error"]:
            lines.append(f"[yellow]no token lengths: {escape(result['tokenizer_error'])}[/yellow]")
        lines.append("")
        lines.append("[b]First examples[/b]")
        for i, ex in enumerate(result["examples"], 1):
            lines.append(f"{i}. {ex}")
        if result["rendered"]:
            lines += ["", "[b]As trained[/b] [dim](example 1; [/dim][green]trained[/green][dim] tokens green)[/dim]"]
            lines += [show_rendered(pieces) for pieces in result["rendered"]]
        info.update("\n".join(lines))

    @on(Input.Changed)
    def _changed(self, event: Input.Changed) -> None:
        ident = event.input.id or ""
        if not ident.startswith("f-"):
            return
        name = ident[2:]
        if name == "model":
            self._check_model(event.value)
            data = self.query_one("#f-data", Input).value
            if data and check_data_path(data) is None and "model" not in self.errors:
                self._check_data(data)  # token lengths depend on the tokenizer
        elif name == "data":
            self._check_data(event.value)
        elif name == "out":
            self._check_out(event.value)
        else:
            self._check_field(name, event.value)
            data = self.query_one("#f-data", Input).value
            if name == "chat_template_kwargs" and data and check_data_path(data) is None:
                self._check_data(data)  # the rendering depends on them
        self.query_one("#form-error", Static).display = False

    @on(Input.Submitted, "#f-model")
    def _submit_model(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if check_model(value)[0] is None and parse_id(value) is not None and not os.path.exists(value):
            self.errors["model"] = "still fetching the model"  # Start waits for it
            self.query_one("#model-info", Static).update(
                f"[b]Model[/b] {escape(value)}  [dim]fetching from the Hugging Face Hub…[/dim]")
            self.fetch_model(value)

    @work(thread=True, exclusive=True, group="fetch")
    def fetch_model(self, value: str) -> None:
        try:
            path, error = resolve_model(value)[1], None
        except UserError as e:
            path, error = None, str(e)
        except Exception as e:  # a download must never take the app down
            path, error = None, f"{type(e).__name__}: {e}"
        self.app.call_from_thread(self._fetched, value, path, error)

    def _fetched(self, value: str, path: str | None, error: str | None) -> None:
        if self.query_one("#f-model", Input).value.strip() != value:
            return  # typed on since
        self._set_error("model", error)
        if path:
            self.query_one("#model-info", Static).update(
                f"[b]Model[/b] {escape(value)}  [dim]fetched: {escape(path)}[/dim]")

    @on(Select.Changed, "#f-device")
    def _device_changed(self, event: Select.Changed) -> None:
        self._set_error("device", check_device(str(event.value)))

    @property
    def device(self) -> str | None:
        """The device chosen: "cpu", "gpu", or None for the GPU where there is one."""
        try:
            value = str(self.query_one("#f-device", Select).value)
        except Exception:  # not composed yet
            return None
        return None if value == "auto" else value

    @on(Select.Changed, "#f-method")
    def _method_changed(self, event: Select.Changed) -> None:
        self._apply_method(str(event.value))

    @on(Select.Changed, "#f-objective")
    def _objective_changed(self, event: Select.Changed) -> None:
        # beta follows the objective's default unless it was edited
        beta = self.query_one("#f-beta", Input)
        new = beta_default(str(event.value))
        if beta.value.strip() in {_fmt(beta_default(o)) for o in BETA}:
            beta.value = _fmt(new)
        self._apply_method(self._method())

    def _objective(self) -> str:
        try:
            return str(self.query_one("#f-objective", Select).value)
        except Exception:
            return str(field_default("objective"))

    def _method(self) -> str:
        try:
            return str(self.query_one("#f-method", Select).value)
        except Exception:
            return "lora"

    def _apply_method(self, method: str) -> None:
        self._check_model(self.query_one("#f-model", Input).value)
        for f in FIELDS:
            shown = f.applies(method, self._objective())
            self.query_one(f"#row-{f.name}").display = shown
            self._check_field(f.name, self.query_one(f"#f-{f.name}", Input).value)  # shown: its errors count
            err = self.query_one(f"#e-{f.name}", Static)
            err.display = shown and f.name in self.errors

    # ---------------------------------------------------------------- browsing

    @on(Button.Pressed, "#browse-model")
    def _browse_model(self) -> None:
        self.action_browse("model")

    @on(Button.Pressed, "#browse-data")
    def _browse_data(self) -> None:
        self.action_browse("data")

    def action_browse(self, which: str) -> None:
        inp = self.query_one(f"#f-{which}", Input)
        current = inp.value.strip()
        start = os.path.dirname(current) if os.path.isfile(os.path.expanduser(current)) else (current or ".")
        if which == "model":
            picker = FilePicker("Pick a model (.gguf) or a Hugging Face folder", start, (".gguf",), folders=True)
        else:
            picker = FilePicker("Pick training data (.jsonl, .txt) or a data folder", start,
                                (".jsonl", ".txt"), folders=True)

        def picked(path: str | None) -> None:
            if path:
                inp.value = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
                inp.focus()

        self.app.push_screen(picker, picked)

    # ---------------------------------------------------------------- start

    @on(Button.Pressed, "#start")
    def _start_pressed(self) -> None:
        self.action_start()

    def collect(self) -> dict[str, Any] | None:
        """The config for the trainer, or None (with the reasons shown) when something is wrong."""
        method = str(self.query_one("#f-method", Select).value)
        objective = str(self.query_one("#f-objective", Select).value)
        relevant = {"model", "device", "data", "out"} | {f.name for f in FIELDS if f.applies(method, objective)}
        errors = {k: v for k, v in self.errors.items() if k in relevant}
        form_error = self.query_one("#form-error", Static)
        if errors:
            name, why = next(iter(errors.items()))
            form_error.update(f"✗ fix {name.replace('_', ' ')} first: {escape(why)}")
            form_error.display = True
            try:
                self.query_one(f"#f-{name}").focus()
            except Exception:
                pass
            return None
        model = self.query_one("#f-model", Input).value.strip()
        if os.path.exists(os.path.expanduser(model)):  # a path, not a built-in name
            model = os.path.abspath(os.path.expanduser(model))
        # absolute paths: the run's config.yaml must not depend on where the UI was started
        cfg: dict[str, Any] = {
            "model": model,
            "data": os.path.abspath(os.path.expanduser(self.query_one("#f-data", Input).value.strip())),
            "out": os.path.abspath(os.path.expanduser(self.query_one("#f-out", Input).value.strip())),
            "method": method,
            "objective": str(self.query_one("#f-objective", Select).value),
        }
        for f in FIELDS:
            if f.applies(method, objective):
                cfg[f.name] = self.values[f.name]
        if method == "scratch":
            cfg["n_kv_heads"] = cfg["n_heads"]
            cfg["d_head"] = max(1, cfg["d_model"] // cfg["n_heads"])
            cfg["d_ff"] = 4 * cfg["d_model"]
        try:
            make_objective(TrainConfig.from_dict(cfg).validate())  # grpo: its rewards parse (and load)
        except UserError as e:
            form_error.update(f"✗ {escape(str(e))}")
            form_error.display = True
            return None
        form_error.display = False
        return cfg

    def action_start(self) -> None:
        if self.app.run_state.active:  # type: ignore[attr-defined]
            self.notify("A run is in progress: stop it first (F2, then s).", severity="warning")
            return
        cfg = self.collect()
        if cfg is None:
            self.notify("The setup has errors (shown in red).", severity="error")
            return
        self.app.start_training(cfg, self.device)  # type: ignore[attr-defined]

    def on_screen_resume(self) -> None:
        # a new run needs a new folder: the previous default is taken once a run started there
        out = self.query_one("#f-out", Input)
        prefix = os.path.join(self.app.runs_dir, "run-")  # type: ignore[attr-defined]
        if check_out(out.value) is not None and out.value.startswith(prefix):
            out.value = self._default_out()


def _fmt(v: Any) -> str:
    if isinstance(v, dict):
        return json.dumps(v) if v else ""
    if isinstance(v, list):
        return ",".join(map(str, v))
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)
