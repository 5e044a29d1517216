"""mistral: the Llama block (HF MistralForCausalLM), every layer attending over a sliding
window when `sliding_window` is set.

llama.cpp reads Mistral GGUFs as `llama` (its converter writes that arch and no window); a
GGUF has no sliding window for llama, so ours declares a context no longer than the window:
within it llama.cpp computes exactly what the windowed model does. A GGUF reads back as llama.
"""

from __future__ import annotations

from typing import Any

from mlxtoy.arch import llama
from mlxtoy.arch.spec import ArchSpec, Fields
from mlxtoy.model_config import ModelConfig
from mlxtoy.models.llama import LlamaModel


def gguf_out(cfg: ModelConfig) -> dict[str, Any]:
    out = llama.gguf_out(cfg)
    if cfg.sliding_window:
        out["context_length"] = min(int(cfg.context_length), int(cfg.sliding_window))
    return out


def hf_in(f: Fields, raw: dict[str, Any]) -> dict[str, Any]:
    window = f("sliding_window", None)
    return llama.hf_in(f, raw) | {"rope_traditional": True, "sliding_window": int(window) if window else None}


def hf_out(cfg: ModelConfig) -> dict[str, Any]:
    return llama.hf_out(cfg, "MistralForCausalLM", "mistral") | {"sliding_window": cfg.sliding_window}


SPEC = ArchSpec(
    name="mistral", model=LlamaModel, tensors=llama.llama_table(permute=True),
    lora_targets=llama.LORA_TARGETS,
    gguf_arch="llama", gguf_out=gguf_out,
    hf_classes=("MistralForCausalLM",), hf_model_types=("mistral",), hf_in=hf_in, hf_out=hf_out,
    rope_freqs=True, scratch={"rope_traditional": True},
)
