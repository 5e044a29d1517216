"""gpt2: learned positions, LayerNorm with bias, biases everywhere, GELU (tanh) FFN
(`mlxtoy.models.gpt2`).

GGUF fuses q | k | v by rows (each head-major) into `blk.N.attn_qkv`; transformers' Conv1D
modules store weights (in, out), so every HF matrix is transposed, and `c_attn` is the same
fused q | k | v by columns. An `output.weight` equal to `token_embd` (llama.cpp's converter
writes a copy of GPT-2's tied table) reads as tied.
"""

from __future__ import annotations

from typing import Any

from mlxtoy.arch.spec import TRANSPOSE, ArchSpec, Fields, row
from mlxtoy.errors import UserError
from mlxtoy.model_config import ModelConfig
from mlxtoy.models.lora import TARGET_PATHS
from mlxtoy.models.gpt2 import GPT2Model

HF_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
QKV_W = ("attn.q.weight", "attn.k.weight", "attn.v.weight")
QKV_B = ("attn.q.bias", "attn.k.bias", "attn.v.bias")

TENSORS = (
    row("tok_embeddings.weight", "token_embd.weight", "transformer.wte.weight", block=False),
    row("pos_embeddings.weight", "position_embd.weight", "transformer.wpe.weight", block=False),
    row("attn_norm.weight", "attn_norm.weight", "ln_1.weight"),
    row("attn_norm.bias", "attn_norm.bias", "ln_1.bias"),
    row(QKV_W, "attn_qkv.weight", "attn.c_attn.weight", TRANSPOSE),
    row(QKV_B, "attn_qkv.bias", "attn.c_attn.bias"),
    row("attn.o.weight", "attn_output.weight", "attn.c_proj.weight", TRANSPOSE),
    row("attn.o.bias", "attn_output.bias", "attn.c_proj.bias"),
    row("ffn_norm.weight", "ffn_norm.weight", "ln_2.weight"),
    row("ffn_norm.bias", "ffn_norm.bias", "ln_2.bias"),
    row("ffn.up.weight", "ffn_up.weight", "mlp.c_fc.weight", TRANSPOSE),
    row("ffn.up.bias", "ffn_up.bias", "mlp.c_fc.bias"),
    row("ffn.down.weight", "ffn_down.weight", "mlp.c_proj.weight", TRANSPOSE),
    row("ffn.down.bias", "ffn_down.bias", "mlp.c_proj.bias"),
    row("norm.weight", "output_norm.weight", "transformer.ln_f.weight", block=False),
    row("norm.bias", "output_norm.bias", "transformer.ln_f.bias", block=False),
    row("output.weight", "output.weight", "lm_head.weight", block=False),
)


def gguf_in(f: Fields, md: dict[str, Any]) -> dict[str, Any]:
    d_model = f.count("embedding_length")
    n_heads = f.count("attention.head_count")
    vocab = f("vocab_size", None) or len(md.get("tokenizer.ggml.tokens", [])) or None
    if vocab is None:
        raise UserError(f"{f.where}: cannot tell the vocabulary size (no gpt2.vocab_size, no tokens)")
    return dict(vocab_size=int(vocab), d_model=d_model, n_layers=f.count("block_count"),
                n_heads=n_heads, n_kv_heads=n_heads, d_head=d_model // n_heads,
                d_ff=f.count("feed_forward_length", 4 * d_model),
                norm_eps=f.positive("attention.layer_norm_epsilon", 1e-5), rope_dims=0, qkv_bias=True,
                context_length=f.count("context_length"))


def gguf_out(cfg: ModelConfig) -> dict[str, Any]:
    return {"context_length": int(cfg.context_length), "embedding_length": int(cfg.d_model),
            "block_count": int(cfg.n_layers), "feed_forward_length": int(cfg.d_ff),
            "attention.head_count": int(cfg.n_heads),
            "attention.layer_norm_epsilon": float(cfg.norm_eps), "vocab_size": int(cfg.vocab_size)}


def hf_in(f: Fields, raw: dict[str, Any]) -> dict[str, Any]:
    act = f("activation_function", "gelu_new")
    if act not in HF_TANH_GELUS:
        raise UserError(f"{f.where}: activation_function {act!r} is not supported "
                        f"(GPT-2 uses the tanh GELU: {', '.join(HF_TANH_GELUS)})")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if f(flag, False):
            raise UserError(f"{f.where}: {flag} is not supported")
    if f("scale_attn_weights", True) is False:
        raise UserError(f"{f.where}: scale_attn_weights=false is not supported")
    d_model = f.count("n_embd")
    n_heads = f.count("n_head")
    return dict(vocab_size=f.count("vocab_size"), d_model=d_model, n_layers=f.count("n_layer"),
                n_heads=n_heads, n_kv_heads=n_heads, d_head=d_model // n_heads,
                d_ff=f.count("n_inner", 4 * d_model),
                norm_eps=f.positive("layer_norm_epsilon", 1e-5), rope_dims=0, qkv_bias=True,
                tie_embeddings=bool(f("tie_word_embeddings", True)),
                context_length=int(f("n_positions", None) or f("n_ctx", 1024)))


def hf_out(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads, "n_inner": cfg.d_ff, "n_positions": cfg.context_length,
        "n_ctx": cfg.context_length, "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu_new", "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": "float32",
    }


def check(cfg: ModelConfig) -> None:
    if cfg.n_kv_heads != cfg.n_heads or cfg.n_heads * cfg.d_head != cfg.d_model:
        raise UserError("GPT-2 needs n_heads * d_head == d_model and n_kv_heads == n_heads "
                        "(llama.cpp and transformers alike)")


def positions_fix_context(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """The learned position table fixes the context, whatever the metadata says."""
    if "pos_embeddings.weight" in shapes:
        cfg.context_length = int(shapes["pos_embeddings.weight"][0])


SPEC = ArchSpec(
    name="gpt2", model=GPT2Model, tensors=TENSORS,
    lora_targets={t: p for t, p in TARGET_PATHS.items() if t != "gate"},  # up -> GELU -> down
    gguf_arch="gpt2", gguf_in=gguf_in, gguf_out=gguf_out, check_gguf=check,
    hf_classes=("GPT2LMHeadModel",), hf_model_types=("gpt2",), hf_in=hf_in, hf_out=hf_out,
    check_hf=check, hf_block="transformer.h.{i}.", hf_prefix="transformer.", adapters=False,
    fix_config=positions_fix_context, scratch={"rope_dims": 0, "qkv_bias": True},
)
