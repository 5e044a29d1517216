"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): the Llama block with q | k | v fused into one projection
(`qkv_proj`, GGUF `attn_qkv`) and gate | up fused (`gate_up_proj`, GGUF `ffn_up` of 2 * d_ff
rows, gate first), RoPE in the NEOX form over the first `partial_rotary_factor` of each head.

Our module keeps q/k/v per head and gate/up apart (heads stay addressable, every LoRA target
exists); the fusing is the name table's. llama.cpp disables Phi-3's sliding window, so a GGUF
of a windowed model declares a context no longer than the window (as `mlxtoy.arch.mistral`).
LongRoPE (Phi-3 128k, Phi-4-mini's `longrope` scaling) is refused with a one-line error.
"""

from __future__ import annotations

from typing import Any

from mlxtoy.arch import llama, mistral
from mlxtoy.arch.spec import ArchSpec, Fields, row
from mlxtoy.config import ModelConfig
from mlxtoy.errors import UserError
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


def _no_longrope(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    if (cfg.get("rope_scaling") or {}).get("type") == "longrope":
        raise UserError(f"{where}: LongRoPE scaling (long/short factors) is not supported yet")
    return cfg


def hf_in(f: Fields, raw: dict[str, Any]) -> dict[str, Any]:
    out = llama.hf_in(f, raw)
    rp = f("rope_parameters", None) or {}
    factor = f.positive("partial_rotary_factor", rp.get("partial_rotary_factor") or 1.0)
    if out["rope_scaling"]:
        out["rope_scaling"] = {k: v for k, v in out["rope_scaling"].items() if k != "partial_rotary_factor"}
    window = f("sliding_window", None)
    return _no_longrope(out | {"rope_traditional": False, "qkv_bias": False,
                               "rope_dims": int(out["d_head"] * factor),
                               "sliding_window": int(window) if window else None}, f.where)


def hf_out(cfg: ModelConfig) -> dict[str, Any]:
    out = llama.hf_out(cfg, "Phi3ForCausalLM", "phi3")
    out.pop("attention_bias")
    # pad_token_id: transformers' Phi3Config defaults to 32000, past a small vocabulary
    return out | {"partial_rotary_factor": (cfg.rope_dims or cfg.d_head) / cfg.d_head,
                  "sliding_window": cfg.sliding_window, "pad_token_id": None}


def gguf_in(f: Fields, md: dict[str, Any]) -> dict[str, Any]:
    return _no_longrope(llama.gguf_in(f, md) | {"rope_traditional": False, "sliding_window": None}, f.where)


SPEC = ArchSpec(
    name="phi3", model=LlamaModel, tensors=TENSORS, lora_targets=llama.LORA_TARGETS,
    gguf_arch="phi3", gguf_in=gguf_in, gguf_out=mistral.gguf_out,
    hf_classes=("Phi3ForCausalLM",), hf_model_types=("phi3",), hf_in=hf_in, hf_out=hf_out,
)
