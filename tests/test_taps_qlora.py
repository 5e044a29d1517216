"""`mlxtoy taps` on a QLoRA run: the base stays quantized with the adapters unmerged on top (the
decision `generate` takes, `inference.inference_quant`), and the taps it records equal those of
the outside reference, the dense dequantized base with the same adapters merged; a changed
adapter weight moves them (the comparison can fail); `--quantized off` taps the dense merged model."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxtoy.cli import main as cli_main
from mlxtoy.commands import taps as taps_command
from mlxtoy.config import TrainConfig
from mlxtoy.inference import inference_quant, load_for_inference
from mlxtoy.io.quantize import quantize_gguf
from mlxtoy.loading import load, run_quant_plan
from mlxtoy.models.lora import LORA_TYPES
from mlxtoy.models.quant import QUANTIZED_TYPES
from mlxtoy.taps import capture, drift, load_taps
from tests.helpers_export import tiny_model as export_model, write_tiny_gguf
from tests.helpers_train import qa_rows, run_training, write_jsonl

# Relative L2 difference per (layer, site) allowed between the quantized base with unmerged
# adapters and the dense dequantized merged model: the same weights, so only float32 rounding in
# another order (the kernels' 4-bit GEMV also rounds x to 16 bits for prompts of <= 4 tokens: ~3e-5).
TOLERANCE = 1e-4
TARGETS = ["q", "v", "o", "down"]
PROMPT = "12 plus one is 13"


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """A tiny llama as a Q4_0 GGUF (llama.cpp's quantizer) and a 3-step QLoRA run on it."""
    root = tmp_path_factory.mktemp("taps_qlora")
    model = export_model("llama_gqa", seed=5)
    f32 = write_tiny_gguf(str(root / "tiny-f32.gguf"), model, "f32")
    q4 = quantize_gguf(f32, str(root / "tiny-q4_0.gguf"), "q4_0")
    run = str(root / "run")
    cfg = TrainConfig(model=q4, data=write_jsonl(str(root / "data.jsonl"), qa_rows(16)), out=run, method="lora",
                      steps=3, batch_size=2, seq_len=32, lr=1e-2, warmup=1, eval_every=0, save_every=0,
                      qlora="on", seed=0, lora_targets=TARGETS)
    assert run_training(cfg, handle_sigint=False).reason == "finished"
    return q4, run


def _kinds(model) -> tuple[int, int, int]:
    """(LoRA layers on a quantized base, LoRA layers, quantized modules) of `model`."""
    modules = [m for _, m in model.named_modules()]
    adapters = [m for m in modules if isinstance(m, LORA_TYPES)]
    return (sum(isinstance(m.base, QUANTIZED_TYPES) for m in adapters), len(adapters),
            sum(isinstance(m, QUANTIZED_TYPES) for m in modules))


def _worst(a: dict, b: dict) -> float:
    return max(row["drift"] for row in drift(a, b))


@pytest.mark.core
def test_taps_of_a_qlora_run_equal_the_dense_merged_model(qlora_run):
    q4, run = qlora_run
    assert inference_quant(q4, run) == run_quant_plan(run) and inference_quant(q4, run, "off") is None
    assert run_quant_plan(run) is not None
    qmodel, tokenizer = load_for_inference(q4, run)
    on_base, adapters, _ = _kinds(qmodel)
    assert adapters == len(TARGETS) * qmodel.config.n_layers and on_base == adapters
    reference, _ = load(q4, adapter=run)  # the outside reference: dequantized, adapters merged
    assert _kinds(reference) == (0, 0, 0)

    tokens = mx.array([tokenizer.encode(PROMPT)])
    ours = capture(qmodel, tokens, heads=True)
    theirs = capture(reference, tokens, heads=True)
    assert sorted(ours) == sorted(theirs)  # every layer's sites and per-head views, no more
    assert {site for _, site in ours} == {"attn_norm", "ffn_out", "resid_post", "attn_entropy", "head_out_norm"}
    assert _worst(ours, theirs) < TOLERANCE
    for key in (k for k in ours if k[1] in ("attn_entropy", "head_out_norm")):
        np.testing.assert_allclose(np.array(ours[key]), np.array(theirs[key]), rtol=TOLERANCE, atol=1e-6)

    # positive control: one adapter weight changed in the last layer moves that layer's taps, not the first's
    last = qmodel.config.n_layers - 1
    down = qmodel.layers[last].ffn.down
    down.lora_b = down.lora_b + 0.05
    moved = {(r["layer"], r["site"]): r["drift"] for r in drift(capture(qmodel, tokens), theirs)}
    assert moved[(last, "ffn_out")] > 100 * TOLERANCE and moved[(last, "resid_post")] > 10 * TOLERANCE
    assert max(d for (layer, _), d in moved.items() if layer < last) < TOLERANCE


@pytest.mark.core
def test_taps_command_keeps_the_base_quantized_unless_off(qlora_run, tmp_path, monkeypatch, capsys):
    q4, run = qlora_run
    seen = []

    def spy(model, *args, **kw):
        seen.append(_kinds(model))
        return capture(model, *args, **kw)

    monkeypatch.setattr(taps_command, "capture", spy)
    kept, dense = str(tmp_path / "kept.safetensors"), str(tmp_path / "dense.safetensors")
    args = ["taps", q4, "--adapter", run, "--prompt", PROMPT]
    assert cli_main([*args, "--save", kept, "--json"]) == 0
    assert cli_main([*args, "--quantized", "off", "--save", dense, "--json"]) == 0
    on_base, adapters, quantized = seen[0]
    assert adapters > 0 and on_base == adapters and quantized >= adapters
    assert seen[1] == (0, 0, 0)  # off: the dense base, adapters merged
    assert _worst(load_taps(kept)[0], load_taps(dense)[0]) < TOLERANCE

    # --compare against the saved dense taps, through the command's own drift output
    capsys.readouterr()
    assert cli_main([*args, "--compare", dense, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and max(r["drift"] for r in rows) < TOLERANCE

    with pytest.raises(SystemExit) as bad:
        cli_main([*args, "--quantized", "maybe"])
    assert bad.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "--quantized" in err
