"""qwen3: the Llama block without biases, with a per-head RMSNorm on q and k before RoPE
(`attn_q_norm` / `q_norm`, one (d_head,) weight shared by the heads); RoPE NEOX in GGUF and HF;
head_dim is its own field (d_head * n_heads may differ from d_model)."""

from __future__ import annotations

from typing import Any

from mlxtoy.arch import llama
from mlxtoy.arch.spec import ArchSpec, Fields
from mlxtoy.errors import UserError
from mlxtoy.models.llama import LlamaModel


def hf_in(f: Fields, raw: dict[str, Any]) -> dict[str, Any]:
    if f("use_sliding_window", False):
        raise UserError(f"{f.where}: use_sliding_window=true is not supported for qwen3")
    return llama.hf_in(f, raw) | {"rope_traditional": False, "qk_norm": True, "sliding_window": None}


SPEC = ArchSpec(
    name="qwen3", model=LlamaModel, tensors=llama.llama_table(permute=False),
    lora_targets=llama.LORA_TARGETS,
    gguf_arch="qwen3",
    gguf_in=lambda f, md: llama.gguf_in(f, md) | {"rope_traditional": False, "qk_norm": True},
    gguf_out=llama.gguf_out, check_gguf=llama.no_window,
    hf_classes=("Qwen3ForCausalLM",), hf_model_types=("qwen3",), hf_in=hf_in,
    hf_out=lambda cfg: llama.hf_out(cfg, "Qwen3ForCausalLM", "qwen3") | {"use_sliding_window": False},
    check_hf=llama.no_window, scratch={"rope_traditional": False, "qk_norm": True},
)
