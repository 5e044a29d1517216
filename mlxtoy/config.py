"""Model configuration: one dataclass that every loader fills and every model reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mlxtoy.errors import UserError

SUPPORTED_ARCHS = ("llama", "qwen2")


@dataclass
class ModelConfig:
    arch: str = "llama"  # "llama" or "qwen2"
    vocab_size: int = 32000
    d_model: int = 512
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 8
    d_head: int = 64  # n_heads * d_head may differ from d_model
    d_ff: int = 1376
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_dims: int | None = None  # rotated dims per head; None = d_head
    # "traditional" rotates adjacent pairs (GGML's normal RoPE, how llama-arch GGUFs store
    # W_q/W_k); False is the half-split NEOX form (HF checkpoints, qwen2 GGUFs).
    rope_traditional: bool = True
    rope_scaling: dict[str, Any] | None = None  # {"type": "linear"|"llama3", "factor": ...}
    qkv_bias: bool = False
    tie_embeddings: bool = True
    context_length: int = 2048

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UserError(f"unknown architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff"):
            if int(getattr(self, name)) <= 0:
                raise UserError(f"model config: {name} must be > 0, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"model config: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise UserError(f"model config: unknown keys {sorted(unknown)}")
        return cls(**d)


@dataclass
class LoadedMeta:
    """What a loader learned besides weights: where it came from and the raw metadata."""

    source: str
    format: str  # "gguf" or "hf"
    tensor_types: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
