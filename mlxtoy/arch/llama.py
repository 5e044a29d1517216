"""llama (and Llama 3.x RoPE scaling): the reference spec, and the pieces the Llama family
(qwen2, qwen3, mistral, ...) shares: the name table, GGUF keys and HF config fields.

GGUF stores llama's W_q / W_k rows permuted for GGML's adjacent-pair RoPE (our layout, MLX
traditional=True); HF checkpoints are half-split (NEOX): the `neox` transform, as llama.cpp's
converter permutes.
"""

from __future__ import annotations

from typing import Any

from mlxtoy.arch.spec import ArchSpec, Fields, Transform, neox, rope_kind, row
from mlxtoy.errors import UserError
from mlxtoy.model_config import ModelConfig
from mlxtoy.models.llama import LlamaModel
from mlxtoy.models.lora import TARGET_PATHS

LORA_TARGETS = TARGET_PATHS  # every projection of the shared block


def llama_table(permute: bool) -> tuple:
    """The Llama family's name table; `permute`: q/k rows are NEOX in HF, adjacent-pair here."""
    q_tf: Transform | None = neox("n_heads") if permute else None
    k_tf: Transform | None = neox("n_kv_heads") if permute else None
    return (
        row("tok_embeddings.weight", "token_embd.weight", "model.embed_tokens.weight", block=False),
        row("attn_norm.weight", "attn_norm.weight", "input_layernorm.weight"),
        row("attn.q.weight", "attn_q.weight", "self_attn.q_proj.weight", q_tf),
        row("attn.q.bias", "attn_q.bias", "self_attn.q_proj.bias", q_tf),
        row("attn.k.weight", "attn_k.weight", "self_attn.k_proj.weight", k_tf),
        row("attn.k.bias", "attn_k.bias", "self_attn.k_proj.bias", k_tf),
        row("attn.v.weight", "attn_v.weight", "self_attn.v_proj.weight"),
        row("attn.v.bias", "attn_v.bias", "self_attn.v_proj.bias"),
        # per-head norms (qwen3, gemma3): applied after the permute-free per-head rows
        row("attn.q_norm.weight", "attn_q_norm.weight", "self_attn.q_norm.weight"),
        row("attn.k_norm.weight", "attn_k_norm.weight", "self_attn.k_norm.weight"),
        row("attn.o.weight", "attn_output.weight", "self_attn.o_proj.weight"),
        row("ffn_norm.weight", "ffn_norm.weight", "post_attention_layernorm.weight"),
        row("ffn.gate.weight", "ffn_gate.weight", "mlp.gate_proj.weight"),
        row("ffn.up.weight", "ffn_up.weight", "mlp.up_proj.weight"),
        row("ffn.down.weight", "ffn_down.weight", "mlp.down_proj.weight"),
        row("norm.weight", "output_norm.weight", "model.norm.weight", block=False),
        row("output.weight", "output.weight", "lm_head.weight", block=False),
    )


# --------------------------------------------------------------------------- GGUF metadata

def gguf_in(f: Fields, md: dict[str, Any]) -> dict[str, Any]:
    """The keys every RoPE decoder in llama.cpp shares -> ModelConfig keywords."""
    d_model = f.count("embedding_length")
    n_heads = f.count("attention.head_count")
    d_head = f.count("attention.key_length", d_model // n_heads)
    vocab = f("vocab_size", None) or len(md.get("tokenizer.ggml.tokens", [])) or None
    if vocab is None:
        raise UserError(f"{f.where}: cannot tell the vocabulary size (no {f.prefix}vocab_size, no tokens)")
    scaling = None
    kind = f("rope.scaling.type", "none")
    if kind == "linear":
        scaling = {"type": "linear", "factor": f.positive("rope.scaling.factor")}
    elif kind not in ("none", None):
        raise UserError(f"{f.where}: unsupported rope scaling type {kind!r}")
    window = f("attention.sliding_window", None)
    return dict(vocab_size=int(vocab), d_model=d_model, n_layers=f.count("block_count"),
                n_heads=n_heads, n_kv_heads=f.count("attention.head_count_kv", n_heads), d_head=d_head,
                d_ff=f.count("feed_forward_length"),
                norm_eps=f.positive("attention.layer_norm_rms_epsilon", 1e-5),
                rope_base=f.positive("rope.freq_base", 10000.0),
                rope_dims=f.count("rope.dimension_count", d_head, 0), rope_scaling=scaling,
                sliding_window=int(window) if window else None,
                context_length=f.count("context_length", 2048))


def gguf_out(cfg: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> the shared keys (suffixes under `<arch>.`), in llama.cpp's converter order."""
    out: dict[str, Any] = {
        "context_length": int(cfg.context_length), "embedding_length": int(cfg.d_model),
        "block_count": int(cfg.n_layers), "feed_forward_length": int(cfg.d_ff),
        "attention.head_count": int(cfg.n_heads), "attention.head_count_kv": int(cfg.n_kv_heads),
    }
    if cfg.d_head * cfg.n_heads != cfg.d_model:
        # llama.cpp assumes d_head = d_model / n_heads unless told otherwise.
        out["attention.key_length"] = int(cfg.d_head)
        out["attention.value_length"] = int(cfg.d_head)
    out["rope.freq_base"] = float(cfg.rope_base)
    out["rope.dimension_count"] = int(cfg.rope_dims or cfg.d_head)
    out["attention.layer_norm_rms_epsilon"] = float(cfg.norm_eps)
    out["vocab_size"] = int(cfg.vocab_size)
    if rope_kind(cfg) == "linear":
        out["rope.scaling.type"] = "linear"
        out["rope.scaling.factor"] = float(cfg.rope_scaling["factor"])
    return out


# --------------------------------------------------------------------------- HF config

def hf_in(f: Fields, raw: dict[str, Any]) -> dict[str, Any]:
    """config.json fields every Llama-family model shares -> ModelConfig keywords."""
    d_model = f.count("hidden_size")
    n_heads = f.count("num_attention_heads")
    base, scaling = hf_rope(f)
    return dict(vocab_size=f.count("vocab_size"), d_model=d_model, n_layers=f.count("num_hidden_layers"),
                n_heads=n_heads, n_kv_heads=f.count("num_key_value_heads", n_heads),
                d_head=f.count("head_dim", d_model // n_heads), d_ff=f.count("intermediate_size"),
                norm_eps=f.positive("rms_norm_eps", 1e-6), rope_base=base,
                rope_scaling=scaling, qkv_bias=bool(f("attention_bias", False)),
                tie_embeddings=bool(f("tie_word_embeddings", False)),
                context_length=f.count("max_position_embeddings", 2048))


def hf_rope(f: Fields, params: dict[str, Any] | None = None) -> tuple[float, dict[str, Any] | None]:
    """(RoPE base, scaling or None) from `rope_theta` / `rope_scaling` (checkpoints on the hub)
    or transformers 5's `rope_parameters` (or `params`, one layer type's entry of it)."""
    rp = params if params is not None else (f("rope_parameters", None) or {})
    base = f.positive("rope_theta", rp.get("rope_theta") or 10000.0)
    scaling = f("rope_scaling", None) or {k: v for k, v in rp.items() if k != "rope_theta"}
    if not isinstance(scaling, dict):
        raise UserError(f"{f.where}: rope_scaling must be a mapping, got {scaling!r}")
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return base, None
    return base, dict(scaling, type=kind)


def hf_out(cfg: ModelConfig, hf_class: str, model_type: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architectures": [hf_class], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_head, "intermediate_size": cfg.d_ff, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base, "max_position_embeddings": cfg.context_length,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias, "torch_dtype": "float32",
    }
    kind = rope_kind(cfg)
    if kind == "freq_factors":
        raise UserError("this model's RoPE frequency factors (a GGUF rope_freqs tensor) have no "
                        "exact Hugging Face config equivalent")
    if kind:
        out["rope_scaling"] = {k: v for k, v in cfg.rope_scaling.items() if k != "type"} | {"rope_type": kind}
    return out


def no_window(cfg: ModelConfig) -> None:
    if cfg.sliding_window and cfg.sliding_window < cfg.context_length:
        raise UserError(f"{cfg.arch}: a sliding window of {cfg.sliding_window} positions has no "
                        "equivalent in this format")


SPEC = ArchSpec(
    name="llama", model=LlamaModel, tensors=llama_table(permute=True), lora_targets=LORA_TARGETS,
    gguf_arch="llama", gguf_in=lambda f, md: gguf_in(f, md) | {"rope_traditional": True},
    gguf_out=gguf_out, check_gguf=no_window,
    hf_classes=("LlamaForCausalLM",), hf_model_types=("llama",),
    hf_in=lambda f, raw: hf_in(f, raw) | {"rope_traditional": True},
    hf_out=lambda cfg: hf_out(cfg, "LlamaForCausalLM", "llama"), check_hf=no_window,
    rope_freqs=True, scratch={"rope_traditional": True},
)
