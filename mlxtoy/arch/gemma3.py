"""gemma3 (text models, HF Gemma3ForCausalLM / model_type gemma3_text): `mlxtoy.models.gemma3`.

HF stores every RMSNorm weight as w with the multiplier 1 + w; GGUF (llama.cpp's converter) and
we store 1 + w: the `PLUS_ONE` transform. RoPE is NEOX everywhere (no permute). Layers alternate
sliding-window attention (RoPE base `rope_local_base`, unscaled) and full attention (base
`rope_base`, with the scaling); the softmax scale is query_pre_attn_scalar ** -0.5.

llama.cpp's gemma3 reads the layer pattern (`attention.sliding_window_pattern`, one bool per
layer) and the sliding layers' base (`rope.freq_base_swa`); older GGUFs lack them and mean every
6th layer global and base 10000. Its softmax scale is fixed: key_length ** -0.5
(d_model / n_heads for the 62-layer 27B), so a GGUF refuses a query_pre_attn_scalar that differs.
"""

from __future__ import annotations

from typing import Any

from mlxtoy.arch import llama
from mlxtoy.arch.spec import ArchSpec, Fields, Transform, row
from mlxtoy.errors import UserError
from mlxtoy.model_config import ModelConfig
from mlxtoy.models.gemma3 import Gemma3Model

PLUS_ONE = Transform(lambda w, c: w - 1.0, lambda w, c: w + 1.0, rows=False)
# what llama.cpp assumes when a GGUF does not say: layer i is global when (i + 1) % 6 == 0, the
# sliding layers' RoPE base is 10000
LLAMA_CPP_PATTERN = 6
LLAMA_CPP_LOCAL_BASE = 10000.0

TENSORS = (
    row("tok_embeddings.weight", "token_embd.weight", "model.embed_tokens.weight", block=False),
    row("attn.q.weight", "attn_q.weight", "self_attn.q_proj.weight"),
    row("attn.q_norm.weight", "attn_q_norm.weight", "self_attn.q_norm.weight", PLUS_ONE),
    row("attn.k.weight", "attn_k.weight", "self_attn.k_proj.weight"),
    row("attn.k_norm.weight", "attn_k_norm.weight", "self_attn.k_norm.weight", PLUS_ONE),
    row("attn.v.weight", "attn_v.weight", "self_attn.v_proj.weight"),
    row("attn.o.weight", "attn_output.weight", "self_attn.o_proj.weight"),
    row("ffn.gate.weight", "ffn_gate.weight", "mlp.gate_proj.weight"),
    row("ffn.down.weight", "ffn_down.weight", "mlp.down_proj.weight"),
    row("ffn.up.weight", "ffn_up.weight", "mlp.up_proj.weight"),
    row("attn_norm.weight", "attn_norm.weight", "input_layernorm.weight", PLUS_ONE),
    row("post_attn_norm.weight", "post_attention_norm.weight", "post_attention_layernorm.weight", PLUS_ONE),
    row("ffn_norm.weight", "ffn_norm.weight", "pre_feedforward_layernorm.weight", PLUS_ONE),
    row("post_ffn_norm.weight", "post_ffw_norm.weight", "post_feedforward_layernorm.weight", PLUS_ONE),
    row("norm.weight", "output_norm.weight", "model.norm.weight", PLUS_ONE, block=False),
)


def pattern(n_layers: int, every: int) -> list[str]:
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]


def hf_in(f: Fields, raw: dict[str, Any]) -> dict[str, Any]:
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if f(cap, None) is not None:
            raise UserError(f"{f.where}: {cap} is not supported (Gemma 3 has none)")
    if f("use_bidirectional_attention", False):
        raise UserError(f"{f.where}: use_bidirectional_attention is not supported")
    out = llama.hf_in(f, raw)
    rp = f("rope_parameters", None) or {}
    if "full_attention" in rp:  # transformers 5: one RoPE entry per layer type
        base, scaling = llama.hf_rope(Fields({}, "", f.where, "field"), rp["full_attention"])
        local = float(rp.get("sliding_attention", {}).get("rope_theta", LLAMA_CPP_LOCAL_BASE))
    else:
        base, scaling = out["rope_base"], out["rope_scaling"]
        local = f.positive("rope_local_base_freq", LLAMA_CPP_LOCAL_BASE)
    layer_types = f("layer_types", None) or pattern(out["n_layers"], f.count("sliding_window_pattern", 6))
    return out | {"rope_traditional": False, "qk_norm": True, "qkv_bias": False, "tie_embeddings": True,
                  "rope_base": base, "rope_scaling": scaling, "rope_local_base": local,
                  "sliding_window": f.count("sliding_window"), "layer_types": list(layer_types),
                  "attn_scale": f.positive("query_pre_attn_scalar") ** -0.5}


def hf_out(cfg: ModelConfig) -> dict[str, Any]:
    scalar = (cfg.attn_scale or cfg.d_head ** -0.5) ** -2
    if abs(scalar - round(scalar)) < 1e-6 * scalar:  # transformers wants the int it was given
        scalar = int(round(scalar))
    out = llama.hf_out(cfg, "Gemma3ForCausalLM", "gemma3_text")
    full = {"rope_type": "default", "rope_theta": cfg.rope_base} | (
        {k: v for k, v in out.pop("rope_scaling").items()} if "rope_scaling" in out else {})
    for legacy in ("rope_theta", "hidden_act", "attention_bias"):
        out.pop(legacy, None)
    # the older flat keys too: mlx-lm's gemma3_text reads those (and an int layer pattern)
    legacy: dict[str, Any] = {"rope_theta": cfg.rope_base, "rope_local_base_freq": cfg.rope_local_base or cfg.rope_base}
    if "rope_type" in full and full["rope_type"] != "default":
        legacy["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    every = next((p for p in range(1, cfg.n_layers + 1) if pattern(cfg.n_layers, p) == cfg.layer_types), None)
    if every is not None:
        legacy["sliding_window_pattern"] = every
    return out | legacy | {
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
        "sliding_window": cfg.sliding_window, "layer_types": cfg.layer_types, "tie_word_embeddings": True,
        "rope_parameters": {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.rope_local_base or cfg.rope_base}},
        "final_logit_softcapping": None, "attn_logit_softcapping": None}


def llama_cpp_scale(n_layers: int, d_model: int, n_heads: int, d_head: int) -> float:
    return (d_model / n_heads) ** -0.5 if n_layers == 62 else d_head ** -0.5


def gguf_in(f: Fields, md: dict[str, Any]) -> dict[str, Any]:
    out = llama.gguf_in(f, md)
    layer_types = local = None
    if out["sliding_window"]:
        marks = f("attention.sliding_window_pattern", LLAMA_CPP_PATTERN)
        if isinstance(marks, (int, float)):
            layer_types = pattern(out["n_layers"], int(marks))
        else:
            layer_types = ["sliding_attention" if m else "full_attention" for m in marks]
        local = float(f("rope.freq_base_swa", LLAMA_CPP_LOCAL_BASE))
    return out | {"rope_traditional": False, "qk_norm": True, "tie_embeddings": True,
                  "layer_types": layer_types, "rope_local_base": local,
                  "attn_scale": llama_cpp_scale(out["n_layers"], out["d_model"], out["n_heads"], out["d_head"])}


def gguf_out(cfg: ModelConfig) -> dict[str, Any]:
    out = llama.gguf_out(cfg)
    out["attention.key_length"] = out["attention.value_length"] = int(cfg.d_head)
    if cfg.sliding_window:
        out["attention.sliding_window"] = int(cfg.sliding_window)
        types = cfg.layer_types or ["sliding_attention"] * cfg.n_layers
        out["attention.sliding_window_pattern"] = [t == "sliding_attention" for t in types]
        out["rope.freq_base_swa"] = float(cfg.rope_local_base or cfg.rope_base)
    return out


def check_gguf(cfg: ModelConfig) -> None:
    """Refuse what llama.cpp's gemma3 would compute differently."""
    want = llama_cpp_scale(cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head)
    if abs((cfg.attn_scale or cfg.d_head ** -0.5) - want) > 1e-6 * want:
        raise UserError(f"gemma3: llama.cpp scales attention by {want:.6g} (query_pre_attn_scalar = "
                        f"head_dim); this model's {cfg.attn_scale:.6g} has no GGUF equivalent")


SPEC = ArchSpec(
    name="gemma3", model=Gemma3Model, tensors=TENSORS, lora_targets=llama.LORA_TARGETS,
    gguf_arch="gemma3", gguf_in=gguf_in, gguf_out=gguf_out, check_gguf=check_gguf,
    hf_classes=("Gemma3ForCausalLM",), hf_model_types=("gemma3_text",), hf_in=hf_in, hf_out=hf_out,
    scratch={"rope_traditional": False, "qk_norm": True, "tie_embeddings": True},
)
