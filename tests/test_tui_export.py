"""Export from the TUI's Runs screen: a trained run exported through the dialog (the choices of
`mlxtoy export`) as a merged GGUF that llama.cpp loads with the run's own logits, and as a LoRA
adapter GGUF on the base; a choice the CLI refuses is refused before anything is written."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from textual.widgets import Input, Select, Static

from helpers_export import llama_cpp_logits, max_rel_diff, our_logits, tiny_model, tokens_128
from mlxtoy import load
from mlxtoy.cli import main as cli_main
from mlxtoy.export import DTYPES, FILE_FORMATS, FORMATS, check_format, dtypes_for, export_model
from mlxtoy.errors import UserError
from mlxtoy.io.tokenizer import Tokenizer
from tui.app import MlxtoyApp
from tui.export import ExportScreen, default_output

SIZE = (110, 36)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GGUF base and a 4-step LoRA run on it under runs/."""
    root = tmp_path_factory.mktemp("tui-export")
    base = tiny_model("llama_gqa")
    tok = Tokenizer.from_gguf_metadata(base.meta.metadata, source=base.meta.source)
    base_path = export_model(base, tok, str(root / "base.gguf"), "gguf", "f32")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"the rain in spain number {i} falls on the plain"}) + "\n"
                            for i in range(40)))
    run = str(root / "runs" / "tiny-lora")
    assert cli_main(["train", "--model", base_path, "--data", str(data), "--out", run, "--steps", "4",
                     "--save-every", "0", "--batch-size", "2", "--seq-len", "64", "--lora-rank", "4",
                     "--lora-targets", "q,v", "--lr", "1e-2", "--eval-every", "0"]) == 0
    return {"root": root, "base": base_path, "run": run}


async def wait_for(pilot, cond, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.05)


async def export_through_dialog(trained, fmt: str, dtype: str, out: str) -> str | None:
    """F4, the run selected, e, the choices set, ctrl+s; -> None when the dialog closed after
    exporting, else the error it shows (and stays open with)."""
    app = MlxtoyApp(model=trained["base"], runs_dir=str(trained["root"] / "runs"))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await wait_for(pilot, lambda: getattr(app.screen, "selected", None) is not None, 30, "the run listed")
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, ExportScreen), 10, "the export dialog")
        dialog = app.screen
        assert dialog.query_one("#export-out", Input).value == default_output(trained["run"], "gguf", "f16")
        dialog.query_one("#export-format", Select).value = fmt
        await pilot.pause(0.2)
        dialog.query_one("#export-dtype", Select).value = dtype
        await pilot.pause(0.2)
        dialog.query_one("#export-out", Input).value = out
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is not dialog or dialog.error is not None, 180, "the export")
        error = dialog.error if app.screen is dialog else None
        if error is not None:
            assert str(dialog.query_one("#export-status", Static).render()).strip() in (
                error, f"export failed: {error}")
            await pilot.press("escape")
        await pilot.press("q")  # quit as a user does: the app's MLX thread is shut down
    return error


def run_async(coro):
    return asyncio.run(coro)


def test_dialog_exports_a_gguf_llama_cpp_runs(trained, tmp_path):
    out = str(tmp_path / "merged.gguf")
    assert run_async(export_through_dialog(trained, "gguf", "f32", out)) is None
    tokens = tokens_128()
    ours = our_logits(load(trained["base"], adapter=trained["run"])[0], tokens)
    assert max_rel_diff(llama_cpp_logits(out, tokens), ours) <= 1e-4
    base = our_logits(load(trained["base"])[0], tokens)
    assert max_rel_diff(base, ours) > 1e-3  # positive control: the run moved the logits


def test_dialog_exports_an_adapter_gguf(trained, tmp_path):
    out = str(tmp_path / "adapter.gguf")
    assert run_async(export_through_dialog(trained, "adapter-gguf", "f32", out)) is None
    tokens = tokens_128()
    ours = our_logits(load(trained["base"], adapter=trained["run"])[0], tokens)
    assert max_rel_diff(llama_cpp_logits(trained["base"], tokens, lora_path=out), ours) <= 1e-4


def test_dialog_refuses_what_the_cli_refuses(trained, tmp_path):
    """An output path that is a folder, for a one-file format: the CLI's error, shown in the
    dialog before anything loads; the dialog stays open and nothing is written."""
    folder = tmp_path / "a-folder"
    folder.mkdir()
    error = run_async(export_through_dialog(trained, "gguf", "f16", str(folder)))
    assert error is not None and "is a folder" in error, error
    assert os.listdir(folder) == []


def test_dtypes_for_agrees_with_check_format():
    """The dialog offers exactly the types the CLI accepts for each format."""
    for fmt in FORMATS:
        for dtype in DTYPES:
            try:
                check_format(fmt, dtype)
                accepted = True
            except UserError as e:
                accepted = "llama.cpp" in str(e) or "llama-quantize" in str(e)  # offered; the quantizer is missing
            assert accepted == (dtype in dtypes_for(fmt)), (fmt, dtype)
    assert default_output("/runs/a", "hf", "f16") == "/runs/a-hf-f16"
    assert all(default_output("/runs/a", f, "f32").endswith(".gguf") for f in FILE_FORMATS)
