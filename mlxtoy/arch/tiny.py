"""tiny: the reference TransformerLM (`mlxtoy.models.tiny`), trained from scratch with a
character tokenizer; it lives in run directories only (no GGUF, no Hugging Face equivalent)."""

from __future__ import annotations

from mlxtoy.arch.spec import ArchSpec
from mlxtoy.models.lora import TARGET_PATHS
from mlxtoy.models.tiny import TinyLM

SPEC = ArchSpec(
    name="tiny", model=TinyLM, tensors=(),
    lora_targets={t: p for t, p in TARGET_PATHS.items() if t != "gate"},  # up -> GELU -> down
    adapters=False,
    no_gguf="the reference TransformerLM (arch tiny) has no llama.cpp GGUF equivalent; "
            "use its run directory (mlxtoy generate --model RUN)",
    tokenizer="char", scratch={"rope_dims": 0},
)
