"""Model configuration: one dataclass that every loader fills and every model reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mlxtoy.errors import UserError

SUPPORTED_ARCHS = ("llama", "qwen2", "gpt2", "tiny")  # gpt2/tiny: mlxtoy.models.gpt2, .tiny


@dataclass
class ModelConfig:
    arch: str = "llama"  # "llama", "qwen2", "gpt2" or "tiny" (the reference TransformerLM)
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


# ---------------------------------------------------------------------------------------------
# Training configuration
# ---------------------------------------------------------------------------------------------

TRAIN_METHODS = ("lora", "full", "scratch")
SCHEDULES = ("cosine", "linear", "constant")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
DTYPES = ("auto", "float32", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "sgd")


@dataclass
class TrainConfig:
    """Everything a training run needs; `config.yaml` in a run directory is this, resolved.

    Every field is settable in a YAML file and by the CLI flag of the same name (`_` -> `-`).
    """

    # what to train on
    model: str = "smollm2-135m"  # base model (lora/full) or tokenizer source (scratch)
    data: str = ""  # a .jsonl/.txt file, or a folder with train/valid(/test) files
    out: str = ""  # the run directory
    method: str = "lora"  # lora | full | scratch
    tokenizer: str | None = None  # scratch: take the tokenizer from here instead of `model`

    # optimisation
    steps: int = 200  # total optimizer steps (a resumed run continues up to this)
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 1e-4
    optimizer: str = "adamw"  # adamw (Adam with decoupled weight decay) | sgd
    warmup: int = 0  # steps of linear warm-up from 0
    schedule: str = "cosine"  # cosine | linear | constant (after warm-up)
    min_lr: float = 0.0  # where cosine / linear decay ends
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global gradient norm; 0 = off
    grad_accum: int = 1  # micro-batches per optimizer step
    grad_checkpoint: bool = False  # recompute each block in the backward pass (long sequences)
    dtype: str = "auto"  # compute dtype: auto = the backend's (float32 on CPU)
    qlora: str = "auto"  # keep a quantized base quantized (auto: on Metal/CUDA only), on, off

    # LoRA
    lora_rank: int = 8
    lora_alpha: float = 16.0  # scale = alpha / rank
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q", "v"])
    lora_per_head_q: bool = False  # the seed's per-head Q adapter (A_h, B_h per Q head)
    lora_layers: list[int] | None = None  # block indices (negative from the end); None = all

    # full fine-tuning: block weights always; these are opt-in
    train_embeddings: bool = False
    train_norm: bool = False
    train_output: bool = False  # with tied embeddings this trains the shared table

    # from scratch: model shape (vocab comes from the tokenizer)
    arch: str = "llama"  # llama | qwen2 | gpt2 | tiny (the reference TransformerLM, char tokenizer)
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    d_head: int = 64
    d_ff: int = 688
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_scale: float = 1.0  # matmul weights ~ N(0, init_scale / sqrt(fan_in))
    lens: str | None = None  # scratch: embed via this model's token table (frozen) @ a trained projection

    # data
    pack: bool = True  # several examples per row with a block-causal mask; False = padding
    mask_prompt: bool = True  # loss only on completions / assistant turns
    valid_fraction: float = 0.1  # held out when `data` is a single file (seeded split)

    # the loop
    eval_every: int = 50  # 0 = only at the end
    eval_batches: int = 20  # -1 = the whole validation set
    sample_every: int = 0  # 0 = never
    sample_prompts: list[str] = field(default_factory=list)  # empty: first validation prompts
    sample_tokens: int = 48
    save_every: int = 100  # 0 = only at the end
    keep_checkpoints: int = 3  # newest N kept; 0 = all
    taps_every: int = 0  # call the taps hook every K steps (0 = never)
    seed: int = 0
    eval_accuracy: bool = False  # greedy exact-match accuracy on the test split, before and after
    accuracy_examples: int = 0  # 0 = the whole test split

    def __post_init__(self) -> None:
        # YAML / CLI lists may arrive as "q,v" strings
        if isinstance(self.lora_targets, str):
            self.lora_targets = [t.strip() for t in self.lora_targets.split(",") if t.strip()]
        if isinstance(self.lora_layers, int) and not isinstance(self.lora_layers, bool):
            self.lora_layers = [self.lora_layers]
        if isinstance(self.lora_layers, str):
            self.lora_layers = [int(t) for t in self.lora_layers.split(",") if t.strip()]
        if isinstance(self.betas, str):
            self.betas = [float(t) for t in self.betas.split(",")]
        if isinstance(self.sample_prompts, str):
            self.sample_prompts = [self.sample_prompts]

    def validate(self) -> "TrainConfig":
        def bad(msg: str) -> UserError:
            return UserError(f"train config: {msg}")

        if self.method not in TRAIN_METHODS:
            raise bad(f"method must be one of {', '.join(TRAIN_METHODS)}, got {self.method!r}")
        if self.schedule not in SCHEDULES:
            raise bad(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.dtype not in DTYPES:
            raise bad(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.qlora not in ("auto", "on", "off"):
            raise bad(f"qlora must be auto, on or off, got {self.qlora!r}")
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "sample_tokens"):
            if int(getattr(self, name)) <= 0:
                raise bad(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("warmup", "eval_every", "sample_every", "save_every", "taps_every",
                     "keep_checkpoints", "accuracy_examples"):
            if int(getattr(self, name)) < 0:
                raise bad(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise bad(f"lr must be > 0, got {self.lr}")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise bad(f"min_lr must be in [0, lr], got {self.min_lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise bad(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise bad("eps must be > 0, weight_decay and grad_clip >= 0")
        if not 0 <= self.valid_fraction < 1:
            raise bad(f"valid_fraction must be in [0, 1), got {self.valid_fraction}")
        if self.eval_batches == 0 or self.eval_batches < -1:
            raise bad(f"eval_batches must be > 0 or -1 (all), got {self.eval_batches}")
        if self.method == "lora":
            if self.lora_rank <= 0:
                raise bad(f"lora_rank must be > 0, got {self.lora_rank}")
            if self.lora_alpha <= 0:
                raise bad(f"lora_alpha must be > 0, got {self.lora_alpha}")
            if not 0 <= self.lora_dropout < 1:
                raise bad(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
            if not self.lora_targets:
                raise bad("lora_targets is empty")
            unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
            if unknown:
                raise bad(f"unknown LoRA target {unknown[0]!r} (choose from {', '.join(LORA_TARGETS)})")
            if self.lora_per_head_q and "q" not in self.lora_targets:
                raise bad("lora_per_head_q needs 'q' in lora_targets")
        if self.method == "scratch":
            for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff"):
                if int(getattr(self, name)) <= 0:
                    raise bad(f"{name} must be > 0, got {getattr(self, name)}")
            if self.n_heads % self.n_kv_heads:
                raise bad(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
            if self.init_scale <= 0:
                raise bad(f"init_scale must be > 0, got {self.init_scale}")
            if self.arch not in SUPPORTED_ARCHS:
                raise bad(f"unknown arch {self.arch!r} (choose from {', '.join(SUPPORTED_ARCHS)})")
        if self.optimizer not in OPTIMIZERS:
            raise bad(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.lens and self.method != "scratch":
            raise bad("lens (a projection-lens warm start) needs method scratch")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "TrainConfig":
        known = set(cls.__dataclass_fields__)
        d = {k: v for k, v in d.items() if k != "run"}  # a run's config.yaml: resolved extras
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"{source}: unknown key {unknown[0]!r}")
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise UserError(f"{source}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str) -> "TrainConfig":
        return cls.from_dict(load_yaml(path), source=path)

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The from-scratch model this config describes."""
        return ModelConfig(arch=self.arch, vocab_size=vocab_size, d_model=self.d_model,
                           n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           d_head=self.d_head, d_ff=self.d_ff, norm_eps=self.norm_eps,
                           rope_base=self.rope_base, rope_traditional=True,
                           tie_embeddings=self.tie_embeddings, context_length=self.seq_len)


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise UserError(f"{where}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    return data
