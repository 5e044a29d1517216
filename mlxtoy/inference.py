"""How a front end loads a model to run it (`generate`, `chat`, `serve`, `taps`, the TUI's chat panel):
which base to load and how to keep it, as `loading.quant_plan` (the one quantization policy,
which training asks too) decides.

A QLoRA run's base stays quantized as it trained, its adapters unmerged on top (merging them
would need the whole base dense: an 8B in float32 does not fit in memory); any other model
follows the rule of `train --qlora auto`, and on a CPU with the kernels a 500M+ model whose file
holds blocks that load as they are stays quantized (the same weights, fewer bytes a token).
`--quantized auto|on|off` (QUANTIZED_FLAG, declared once here for every command that takes it)
overrides that.
"""

from __future__ import annotations

import os
from typing import Any

from mlxtoy.errors import UserError
from mlxtoy.io.registry import DEFAULT_MODEL
from mlxtoy.loading import QUANT_MODES, adapter_weights, load, quant_plan, run_quant_plan
from mlxtoy.models.adapters import attach_adapters
from mlxtoy.models.quant import QuantPlan
from mlxtoy.rundir import is_run_or_checkpoint, locate

QUANTIZED_FLAG: dict[str, Any] = {  # `add_argument("--quantized", **QUANTIZED_FLAG)`
    "choices": QUANT_MODES,
    "default": "auto",
    "help": "keep the base's projections quantized, as QLoRA keeps them (a GGUF's Q4_0/Q4_1/Q8_0 "
            "blocks as they are, other weights 4-bit; a run's adapters then stay unmerged on top). "
            "auto (default): as a QLoRA run trained; else where `train --qlora auto` would (on "
            "Metal/CUDA for a quantized file, on CPU when float32 would not fit in memory), and "
            "on a CPU with the kernels for a model of 500M+ parameters whose blocks load as they "
            "are (Q4_0/Q4_1/Q8_0, mlx-lm 4/8-bit): the same weights, decoded several times faster",
}
# what takes less memory when generating runs out of it (`backend.out_of_memory_error`)
GENERATE_FIXES = ["--quantized on (the base kept quantized)", "a smaller --max-tokens (a shorter cache)"]


def inference_quant(model: str | None, adapter: str | None, mode: str = "auto") -> QuantPlan | None:
    """How `load` keeps the base for running it (its `quant`): None dense, a QuantPlan quantized,
    as `loading.quant_plan` decides for the base that runs: `model`, else the run `adapter`'s own
    base (a run given as MODEL counts as `adapter`), else the built-in model."""
    if adapter is None and model is not None and is_run_or_checkpoint(model):
        adapter, model = model, None  # a run (or RUN/best) as MODEL: its own base, as it trained
    base = model or (locate(adapter)[0].read_config()[0].model if adapter else DEFAULT_MODEL)
    return quant_plan(base, mode, run=adapter, inference=True)


def load_for_inference(model: str | None, adapter: str | None = None, mode: str = "auto"):
    """-> (model, tokenizer) to run: `model` (with the run `adapter`'s weights applied); with
    `adapter` alone, the base that run trained (a run of a 1B model must not meet the built-in
    135M); with neither, the built-in model; kept quantized as `mode` says (`inference_quant`)."""
    quant = inference_quant(model, adapter, mode)
    return load(model or (None if adapter else DEFAULT_MODEL), adapter=adapter, quant=quant)


def adapter_name(spec: str) -> tuple[str, str]:
    """`NAME=RUN` or `RUN` (named after its folder) -> (name, run path)."""
    name, sep, path = spec.partition("=")
    if not sep:
        path = spec
        name = os.path.basename(os.path.normpath(spec))
    if not name or not path:
        raise UserError(f"--adapter {spec!r}: give RUN or NAME=RUN")
    return name, path


def load_for_serving(model: str | None, adapters: list[str], mode: str = "auto"):
    """-> (model, tokenizer, names): a base to serve with every adapter run in `adapters`
    (`RUN` or `NAME=RUN`) applied side by side (`mlxtoy.models.adapters`: a row of a batch
    reads its own; slot i + 1 is adapter i), `names` [base name, adapter names...]. The base:
    `model`, else the first run's own base; kept quantized as a QLoRA run among them trained
    it, else as `loading.quant_plan` keeps the base (a 4-bit file stays 4-bit where `generate`
    would keep it). Every run must be a LoRA / DoRA run of that base."""
    named = [adapter_name(a) for a in adapters]
    seen = set()
    for name, _ in named:
        if name in seen:
            raise UserError(f"two adapters are named {name!r}: name them with --adapter NAME=RUN")
        seen.add(name)
    if not named:
        m, tokenizer = load_for_inference(model, None, mode)
        return m, tokenizer, [served_name(model or DEFAULT_MODEL)]
    runs = []
    for name, path in named:
        cfg = locate(path)[0].read_config()[0]
        if not cfg.adapters:
            raise UserError(f"--adapter {path}: a {cfg.method} run holds full weights, not adapters; "
                            f"serve it as the model instead")
        runs.append((name, path, cfg))
    base = model or runs[0][2].model
    # the base kept as a QLoRA run among them trained it, else as the policy keeps `base`
    run = next((path for _, path, _ in runs if run_quant_plan(path) is not None), runs[0][1])
    m, tokenizer = load(base, quant=quant_plan(base, mode, run=run, inference=True))
    loaded = []
    for name, path, _ in runs:
        weights, layout = adapter_weights(path)
        mc = layout.get("model_config") or {}
        mine = m.config.to_dict()
        for key in ("arch", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff", "vocab_size"):
            if key in mc and mc[key] != mine.get(key):
                raise UserError(f"--adapter {path}: trained on a base with {key} {mc[key]}, the served "
                                f"base {base} has {mine.get(key)}")
        loaded.append((name, weights, layout))
    if served_name(base) in seen:
        raise UserError(f"an adapter is named {served_name(base)!r} like the base: name it with --adapter NAME=RUN")
    attach_adapters(m, loaded)
    m.freeze()
    m.eval()
    return m, tokenizer, [served_name(base)] + [n for n, _, _ in runs]


def served_name(model: str) -> str:
    """What a request's "model" calls MODEL: a file's or folder's name, else MODEL as given."""
    return os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model
