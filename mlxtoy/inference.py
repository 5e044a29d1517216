"""How a front end loads a model to run it (`generate`, `chat`, `taps`, the TUI's chat panel):
the one decision whether the base stays quantized or is loaded dense.

A QLoRA run's base stays quantized as it trained, its adapters unmerged on top (merging them
would need the whole base dense: an 8B in float32 does not fit in memory); any other model
follows the rule of `train --qlora auto`, and on a CPU with the kernels a 500M+ model whose file
holds blocks that load as they are stays quantized (the same weights, fewer bytes a token).
`--quantized auto|on|off` (QUANTIZED_FLAG, declared once here for every command that takes it)
overrides that.
"""

from __future__ import annotations

from typing import Any

from mlxtoy import backend
from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.io.registry import DEFAULT_MODEL
from mlxtoy.loading import kept_exactly, load, run_quant_plan, source_size
from mlxtoy.models import fastmath
from mlxtoy.models.quant import QuantPlan
from mlxtoy.rundir import is_run_or_checkpoint, locate
from mlxtoy.train import memory

QUANTIZED_MODES = ("auto", "on", "off")

QUANTIZED_FLAG: dict[str, Any] = {  # `add_argument("--quantized", **QUANTIZED_FLAG)`
    "choices": QUANTIZED_MODES,
    "default": "auto",
    "help": "keep the base's projections quantized, as QLoRA keeps them (a GGUF's Q4_0/Q4_1/Q8_0 "
            "blocks as they are, other weights 4-bit; a run's adapters then stay unmerged on top). "
            "auto (default): as a QLoRA run trained; else where `train --qlora auto` would (on "
            "Metal/CUDA for a quantized file, on CPU when float32 would not fit in memory), and "
            "on a CPU with the kernels for a model of 500M+ parameters whose blocks load as they "
            "are (Q4_0/Q4_1/Q8_0, mlx-lm 4/8-bit): the same weights, decoded several times faster",
}


def inference_quant(model: str | None, adapter: str | None, mode: str = "auto") -> QuantPlan | str | None:
    """How `load` keeps the base for running it (its `quant`): None dense, a QuantPlan quantized,
    "run" as the QLoRA run `adapter` trained it. auto: a QLoRA run's own way, else the rule of
    `train --qlora auto` (`memory.qlora_plan`, from the file's header); on: quantized (a QLoRA
    run's bits and group size, else 4-bit/g32); off: dense, adapters merged. A dense base whose
    float32 weights alone exceed the machine's memory is refused here, before anything is read."""
    if mode not in QUANTIZED_MODES:
        raise UserError(f"--quantized {mode}: choose from {', '.join(QUANTIZED_MODES)}")
    if adapter is None and model is not None and is_run_or_checkpoint(model):
        adapter, model = model, None  # a run (or RUN/best) as MODEL: its own base, as it trained
    run_cfg = locate(adapter)[0].read_config()[0] if adapter else None
    if run_cfg is not None and not run_cfg.adapters:
        return None  # full / scratch runs hold dense weights of their own
    base = model or (run_cfg.model if run_cfg is not None else DEFAULT_MODEL)
    if mode != "off":
        if run_cfg is not None and run_quant_plan(adapter) is not None:
            return "run"
        plan = memory.qlora_plan(TrainConfig(model=base, method="lora", qlora=mode))
        if plan is not None:
            return plan
    params = source_size(base)[0]
    if mode == "auto" and quantized_runs_faster(params) and kept_exactly(base):
        return QuantPlan()  # the file's own blocks: the same weights, a fraction of the bytes a token
    available, what = memory.machine_memory()
    weights = params * backend.compute_dtype().size
    if available and weights > available:
        raise UserError(f"{base}: its weights take {weights / 1e9:.1f} GB dense, more than the {what} "
                        f"({available / 1e9:.1f} GB); --quantized on keeps the base quantized")
    return None


# Parameters from which a quantized base decodes faster than the dense model on a CPU with the
# kernels: there the products' bytes dominate a token (4.5 bits a weight against 6-32); below,
# the dense model's one fused kernel call a block wins on the calls between products
# (docs/performance.md, "Decoding from a quantized base").
QUANTIZED_DECODE_PARAMS = 500_000_000


def quantized_runs_faster(params: int) -> bool:
    """Whether a model of `params` parameters decodes faster with its base quantized here: on a
    CPU with the kernels from QUANTIZED_DECODE_PARAMS on; not on a CPU without them (slabs
    dequantized per product). (On Metal / CUDA `train --qlora auto`'s rule has already kept it.)"""
    return fastmath.kernels_on() and params >= QUANTIZED_DECODE_PARAMS


def load_for_inference(model: str | None, adapter: str | None = None, mode: str = "auto"):
    """-> (model, tokenizer) to run: `model` (with the run `adapter`'s weights applied); with
    `adapter` alone, the base that run trained (a run of a 1B model must not meet the built-in
    135M); with neither, the built-in model; kept quantized as `mode` says (`inference_quant`)."""
    quant = inference_quant(model, adapter, mode)
    return load(model or (None if adapter else DEFAULT_MODEL), adapter=adapter, quant=quant)
