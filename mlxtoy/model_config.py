"""A model's shape: the one dataclass that every loader fills and every model reads
(ModelConfig), the checked numbers it is filled from, and what a loader learned besides the
weights (LoadedMeta). MLX-free; a training run's options are `mlxtoy.config`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
import math
from typing import Any

from mlxtoy.errors import UserError

# One spec each (mlxtoy/arch/<name>.py, registered in mlxtoy.arch.registry, which checks this list)
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3", "gpt2", "tiny")


@dataclass
class ModelConfig:
    arch: str = "llama"  # a name in SUPPORTED_ARCHS ("tiny": the reference TransformerLM)
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
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3, gemma3)
    sliding_window: int | None = None  # a sliding layer sees the last `sliding_window` positions
    # per layer "sliding_attention" / "full_attention" (HF's words); None: every layer slides
    # when sliding_window is set
    layer_types: list[str] | None = None
    rope_local_base: float | None = None  # RoPE base of sliding layers (gemma3); None: rope_base
    attn_scale: float | None = None  # softmax scale; None: d_head ** -0.5

    def __post_init__(self) -> None:
        # Values come from a stranger's GGUF or config.json: check types and ranges before
        # anything divides by them or allocates from them.
        if self.arch not in SUPPORTED_ARCHS:
            raise UserError(f"unknown architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        for name, top in (("vocab_size", 2**24), ("d_model", 2**17), ("n_layers", 4096), ("n_heads", 4096),
                          ("n_kv_heads", 4096), ("d_head", 2**14), ("d_ff", 2**20),
                          ("context_length", 2**24)):
            v = getattr(self, name)
            if isinstance(v, float) and v.is_integer():
                v = int(v)
                setattr(self, name, v)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= top:
                raise UserError(f"model config: {name} must be a whole number in 1..{top}, got {v!r}")
        for name in ("norm_eps", "rope_base"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise UserError(f"model config: {name} must be a number > 0, got {v!r}")
        if self.rope_dims is not None and (not isinstance(self.rope_dims, int) or isinstance(self.rope_dims, bool)
                                           or not 0 <= self.rope_dims <= self.d_head or self.rope_dims % 2):
            raise UserError(f"model config: rope_dims must be an even number in 0..d_head ({self.d_head}), "
                            f"got {self.rope_dims!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise UserError(f"model config: rope_scaling must be a mapping, got {self.rope_scaling!r}")
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise UserError(f"model config: layer_types has {len(self.layer_types)} entries for "
                            f"{self.n_layers} layers")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"model config: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None for a full-attention layer."""
        if not self.sliding_window:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window)
        return None

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise UserError(f"model config: expected a mapping, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise UserError(f"model config: unknown keys {sorted(unknown)}")
        return cls(**d)


def metadata_number(value: Any, where: str, kind: type = int, minimum: int = 1) -> Any:
    """A number from a model file's metadata (GGUF key or config.json field), checked: finite,
    a whole number >= `minimum` (kind int) or > 0 (kind float); `where` names the key."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where} must be a number, got {value!r}")
    if kind is float and not (math.isfinite(value) and value > 0):
        raise UserError(f"{where} must be > 0, got {value!r}")
    if kind is int and not (math.isfinite(value) and value >= minimum):
        raise UserError(f"{where} must be >= {minimum}, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise UserError(f"{where} must be a whole number, got {value!r}")
        return int(value)
    return float(value)


@dataclass
class LoadedMeta:
    """What a loader learned besides weights: where it came from and the raw metadata."""

    source: str
    format: str  # "gguf" or "hf"
    tensor_types: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    quantization_errors: dict[str, float] = field(default_factory=dict)  # tensor -> relative RMS error added at load
