"""How a front end loads a model to run it (`generate`, `chat`, `taps`, the TUI's chat panel):
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

from typing import Any

from mlxtoy.errors import UserError
from mlxtoy.io.registry import DEFAULT_MODEL
from mlxtoy.loading import QUANT_MODES, load, quant_plan
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
