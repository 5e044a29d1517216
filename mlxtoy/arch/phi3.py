"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): the Llama block with q | k | v fused into one projection
(`qkv_proj`, GGUF `attn_qkv`) and gate | up fused (`gate_up_proj`, GGUF `ffn_up` of 2 * d_ff
rows, gate first), RoPE in the NEOX form over the first `partial_rotary_factor` of each head.

Our module keeps q/k/v per head and gate/up apart (heads stay addressable, every LoRA target
exists); the fusing is the name table's. llama.cpp disables Phi-3's sliding window, so a GGUF
of a windowed model declares a context no longer than the window (as `mlxtoy.arch.mistral`).
LongRoPE (Phi-3 128k, Phi-4-mini): short factors while the positions fit
`original_max_position_embeddings`, long ones past it, and cos/sin scaled by the attention
factor (`mlxtoy.models.llama.RoPE`); in GGUF the factors are the `rope_factors_short` /
`rope_factors_long` tensors and `rope.scaling.attn_factor` / `.original_context_length` keys,
as llama.cpp's converter writes them (llama.cpp picks long or short by its context size).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from mlxtoy.arch import llama, mistral
from mlxtoy.arch.spec import ArchSpec, Fields, row
from mlxtoy.errors import UserError
from mlxtoy.model_config import ModelConfig
from mlxtoy.models.llama import LlamaModel

TENSORS = (
    row("tok_embeddings.weight", "token_embd.weight", "model.embed_tokens.weight", block=False),
    row("attn_norm.weight", "attn_norm.weight", "input_layernorm.weight"),
    row(("attn.q.weight", "attn.k.weight", "attn.v.weight"), "attn_qkv.weight", "self_attn.qkv_proj.weight"),
    row("attn.o.weight", "attn_output.weight", "self_attn.o_proj.weight"),
    row("ffn_norm.weight", "ffn_norm.weight", "post_attention_layernorm.weight"),
    row(("ffn.gate.weight", "ffn.up.weight"), "ffn_up.weight", "mlp.gate_up_proj.weight"),
    row("ffn.down.weight", "ffn_down.weight", "mlp.down_proj.weight"),
    row("norm.weight", "output_norm.weight", "model.norm.weight", block=False),
    row("output.weight", "output.weight", "lm_head.weight", block=False),
)


def longrope(scaling: dict[str, Any], context: int, original: Any, where: str) -> dict[str, Any]:
    """A complete LongRoPE entry: factors, the original context and the attention factor
    (computed as transformers does when the config leaves it out)."""
    original = scaling.get("original_max_position_embeddings") or original
    if not original:
        raise UserError(f"{where}: LongRoPE needs original_max_position_embeddings")
    factor = scaling.get("factor") or context / int(original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(original)))
    return {"type": "longrope", "short_factor": [float(x) for x in scaling["short_factor"]],
            "long_factor": [float(x) for x in scaling["long_factor"]],
            "original_max_position_embeddings": int(original), "attention_factor": float(attention)}


def hf_in(f: Fields, raw: dict[str, Any]) -> dict[str, Any]:
    out = llama.hf_in(f, raw)
    rp = f("rope_parameters", None) or {}
    factor = f.positive("partial_rotary_factor", rp.get("partial_rotary_factor") or 1.0)
    scaling = out["rope_scaling"]
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
        if scaling["type"] == "longrope":
            scaling = longrope(scaling, out["context_length"], f("original_max_position_embeddings", None),
                               f.where)
    window = f("sliding_window", None)
    return out | {"rope_traditional": False, "qkv_bias": False, "rope_dims": int(out["d_head"] * factor),
                  "rope_scaling": scaling, "sliding_window": int(window) if window else None}


def hf_out(cfg: ModelConfig) -> dict[str, Any]:
    out = llama.hf_out(cfg, "Phi3ForCausalLM", "phi3")
    out.pop("attention_bias")
    scaling = cfg.rope_scaling or {}
    if scaling.get("type") == "longrope":
        out["rope_scaling"] = {"type": "longrope", "short_factor": scaling["short_factor"],
                               "long_factor": scaling["long_factor"],
                               "attention_factor": scaling["attention_factor"]}
        out["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    # pad_token_id: transformers' Phi3Config defaults to 32000, past a small vocabulary
    return out | {"partial_rotary_factor": (cfg.rope_dims or cfg.d_head) / cfg.d_head,
                  "sliding_window": cfg.sliding_window, "pad_token_id": None}


def gguf_in(f: Fields, md: dict[str, Any]) -> dict[str, Any]:
    out = llama.gguf_in(f, md) | {"rope_traditional": False, "sliding_window": None}
    if "rope.scaling.original_context_length" in f:  # LongRoPE: the factors are tensors
        out["rope_scaling"] = {"type": "longrope",
                               "original_max_position_embeddings": int(f("rope.scaling.original_context_length")),
                               "attention_factor": float(f("rope.scaling.attn_factor", 1.0))}
    return out


def gguf_out(cfg: ModelConfig) -> dict[str, Any]:
    out = mistral.gguf_out(cfg)
    scaling = cfg.rope_scaling or {}
    if scaling.get("type") == "longrope":
        out["rope.scaling.attn_factor"] = float(scaling["attention_factor"])
        out["rope.scaling.original_context_length"] = int(scaling["original_max_position_embeddings"])
    return out


def gguf_extra_in(cfg: ModelConfig, read: Callable[[str], Any]) -> None:
    """Complete the LongRoPE entry `gguf_in` started with the factor tensors."""
    if (cfg.rope_scaling or {}).get("type") != "longrope":
        return
    for which in ("short", "long"):
        factors = read(f"rope_factors_{which}.weight")
        if factors is None:
            raise UserError(f"phi3 GGUF with LongRoPE keys: missing tensor rope_factors_{which}.weight")
        cfg.rope_scaling[f"{which}_factor"] = [float(x) for x in factors.reshape(-1)]


def gguf_extra_out(cfg: ModelConfig) -> dict[str, np.ndarray]:
    scaling = cfg.rope_scaling or {}
    if scaling.get("type") != "longrope":
        return {}
    return {"rope_factors_long.weight": np.asarray(scaling["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.asarray(scaling["short_factor"], dtype=np.float32)}


SPEC = ArchSpec(
    name="phi3", model=LlamaModel, tensors=TENSORS, lora_targets=llama.LORA_TARGETS,
    gguf_arch="phi3", gguf_in=gguf_in, gguf_out=gguf_out, gguf_extra_in=gguf_extra_in,
    gguf_extra_out=gguf_extra_out,
    hf_classes=("Phi3ForCausalLM",), hf_model_types=("phi3",), hf_in=hf_in, hf_out=hf_out,
    scratch={"rope_traditional": False},
)
