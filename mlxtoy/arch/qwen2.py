"""qwen2: the Llama block with q/k/v biases; RoPE in the NEOX form in GGUF and HF alike."""

from __future__ import annotations

from mlxtoy.arch import llama
from mlxtoy.arch.spec import ArchSpec
from mlxtoy.models.llama import LlamaModel

SPEC = ArchSpec(
    name="qwen2", model=LlamaModel, tensors=llama.llama_table(permute=False),
    lora_targets=llama.LORA_TARGETS,
    gguf_arch="qwen2", gguf_in=lambda f, md: llama.gguf_in(f, md) | {"rope_traditional": False},
    gguf_out=llama.gguf_out, check_gguf=llama.no_window,
    hf_classes=("Qwen2ForCausalLM",), hf_model_types=("qwen2",),
    hf_in=lambda f, raw: llama.hf_in(f, raw) | {
        "rope_traditional": False, "qkv_bias": True, "sliding_window": None,
        "tie_embeddings": bool(f("tie_word_embeddings", True))},
    hf_out=lambda cfg: llama.hf_out(cfg, "Qwen2ForCausalLM", "qwen2"), check_hf=llama.no_window,
    scratch={"rope_traditional": False, "qkv_bias": True},
)
