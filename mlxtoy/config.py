"""A training run's options: TrainConfig, whose fields carry the metadata (help, choices,
range, methods, objectives) that the CLI flags, validation, the TUI form and
docs/configuration.md all read. A model's shape is `mlxtoy.model_config`."""

from __future__ import annotations

from dataclasses import MISSING, Field, asdict, dataclass, field, fields
import math
import typing
from typing import Any, Iterable

import yaml

from mlxtoy.errors import UserError
from mlxtoy.model_config import SUPPORTED_ARCHS, ModelConfig
from mlxtoy.textio import load_yaml

TRAIN_METHODS = ("lora", "dora", "full", "scratch")
ADAPTER_METHODS = ("lora", "dora")  # a frozen base with low-rank adapters (mlxtoy.models.lora)
SCHEDULES = ("cosine", "linear", "constant")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
DTYPES = ("auto", "float32", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion", "muon")  # mlx.optimizers, by name
QLORA_MODES = ("auto", "on", "off")
DASHBOARDS = ("tensorboard", "wandb")  # --report-to (mlxtoy.dashboards; optional extras)
OBJECTIVES = ("sft", "dpo", "orpo", "grpo")  # the loss (mlxtoy.train.objectives); `method` is what is trained
ALL_METHODS = TRAIN_METHODS

# What a number must be (the `check` of a field): one rule shared by validate(), the CLI and
# the TUI form. "pos": > 0; "nat": >= 0 (0 = off); "frac": in [0, 1); "batches": > 0 or -1.
CHECKS = {
    "pos": (lambda v: v > 0, "must be > 0"),
    "nat": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "frac": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "batches": (lambda v: v > 0 or v == -1, "must be > 0, or -1 for all"),
}


def option(default: Any, help: str, *, check: str | None = None, choices: tuple[str, ...] | None = None,
           methods: tuple[str, ...] = ALL_METHODS, label: str | None = None, noun: str | None = None,
           objectives: tuple[str, ...] = OBJECTIVES) -> Any:
    """A TrainConfig field with the metadata that the CLI flags, validate() and the TUI form
    read: help text, a range `check` or `choices` (`noun` names one in errors), the methods and
    the objectives it applies to (set away from its default under another objective, it is an
    error), a form label."""
    meta = {"help": help, "check": check, "choices": choices, "methods": methods, "label": label,
            "noun": noun, "objectives": objectives}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# --beta per objective: (its value when not given, its range check in CHECKS). DPO's KL strength
# and ORPO's odds-ratio weight must be > 0; GRPO's KL weight may be 0 (no reference); SFT has
# no beta (the value is only recorded)
BETA = {"sft": (0.1, "nat"), "dpo": (0.1, "pos"), "orpo": (0.1, "pos"), "grpo": (0.0, "nat")}


@dataclass
class TrainConfig:
    """Everything a training run needs; `config.yaml` in a run directory is this, resolved.

    Every field is settable in a YAML file and by the CLI flag of the same name (`_` -> `-`);
    its metadata (see `option`) is the one source of its help, choices and valid range.
    """

    # what to train on
    model: str = option("smollm2-135m", "base model (.gguf, HF folder, Hugging Face id org/name[@rev], "
                        "or built-in name); scratch: the tokenizer source")
    data: str = option("", "a .jsonl/.txt/.parquet/.csv/.arrow file, a folder with train/valid(/test) "
                       "files, or a Hugging Face dataset id (org/name[@rev])")
    out: str = option("", "the run directory to create")
    method: str = option("lora", "what is trained: LoRA adapters, DoRA adapters (LoRA plus a magnitude "
                         "per output row), every block weight, or a new model",
                         choices=TRAIN_METHODS)
    objective: str = option("sft", "the loss: supervised next-token (sft), preference pairs with DPO "
                            "(against the frozen starting point) or ORPO (no reference), or GRPO (rewards "
                            "on sampled completions)", choices=OBJECTIVES)
    beta: float | None = option(None, "dpo: the KL strength beta (default 0.1); orpo: the weight of the "
                                "odds-ratio term (default 0.1); grpo: the weight of the k3 KL to the "
                                "reference (default 0: none)")
    label_smoothing: float = option(0.0, "dpo: the share of pairs assumed mislabelled (conservative DPO)",
                                    check="frac", label="label smoothing", objectives=("dpo",))
    tokenizer: str | None = option(None, "scratch: take the tokenizer from this model (or char, byte) "
                                   "instead of --model", methods=("scratch",))

    # grpo (mlxtoy.train.grpo, mlxtoy.train.rewards)
    reward: str = option("", "grpo: reward functions, comma-separated: exact, contains, regex:PATTERN, "
                         "numeric, think-format, length:N, or FILE.py:FUNCTION", objectives=("grpo",))
    reward_weights: list[float] | None = option(None, "grpo: one weight per --reward (default 1 each)",
                                                objectives=("grpo",))
    reward_timeout: float = option(300.0, "grpo: seconds one call of a FILE.py:FUNCTION reward may take; "
                                   "past it the run ends with an error (the checkpoints kept)", check="pos",
                                   objectives=("grpo",))
    group_size: int = option(8, "grpo: completions sampled per prompt", check="pos", objectives=("grpo",),
                             label="group size")
    max_completion_tokens: int = option(128, "grpo: tokens per sampled completion at most", check="pos",
                                        objectives=("grpo",))
    temp: float = option(1.0, "grpo: sampling temperature", check="pos", objectives=("grpo",))
    top_p: float = option(1.0, "grpo: nucleus sampling mass (1 = off)", check="pos", objectives=("grpo",))
    min_p: float = option(0.0, "grpo: min-p sampling (0 = off)", check="frac", objectives=("grpo",))
    top_k: int = option(0, "grpo: sample from the k most likely tokens (0 = off)", check="nat", objectives=("grpo",))
    repetition_penalty: float = option(1.0, "grpo: logits of the tokens already in the prompt or the "
                                       "completion are divided by it when positive, multiplied when negative "
                                       "(> 1 discourages repeats; 1 = off)", check="pos", objectives=("grpo",))
    loss_type: str = option("dapo", "grpo: how token terms add up: per-sequence means (grpo), per "
                            "micro-batch tokens (bnpo), over sequences x max completion tokens (dr_grpo), "
                            "over the step's tokens (dapo)", choices=("grpo", "bnpo", "dr_grpo", "dapo"),
                            objectives=("grpo",))
    epsilon: float = option(0.2, "grpo: the ratio's clip below (and above unless --epsilon-high)", check="pos",
                            objectives=("grpo",))
    epsilon_high: float | None = option(None, "grpo: the ratio's clip above (DAPO: 0.28; default --epsilon)",
                                        check="pos", objectives=("grpo",))
    importance_sampling: str = option("token", "grpo: the ratio per token, or per sequence (GSPO)",
                                      choices=("token", "sequence"), objectives=("grpo",))
    scale_rewards: str = option("group", "grpo: divide advantages by the group's reward std, the batch's, "
                                "or nothing (Dr. GRPO)", choices=("group", "batch", "none"), objectives=("grpo",))
    iterations_per_generation: int = option(1, "grpo: optimizer steps on each generation (mu)", check="pos",
                                            objectives=("grpo",))
    skip_zero_std_groups: bool = option(False, "grpo: drop groups whose rewards are all equal and draw more "
                                        "prompts (DAPO's dynamic sampling)", objectives=("grpo",))
    mask_truncated_completions: bool = option(False, "grpo: completions cut by --max-completion-tokens train "
                                              "nothing (DAPO's overlong filtering; they are still scored)",
                                              objectives=("grpo",))
    eval_generations: int = option(0, "grpo: also score N sampled completions of each validation prompt at "
                                   "every evaluation, beside the greedy one (sampled/reward; 0 = off)",
                                   check="nat", objectives=("grpo",))

    # optimisation
    steps: int = option(200, "total optimizer steps (a resumed run continues up to this)", check="pos")
    epochs: int = option(0, "train for N passes over the training data instead of --steps (0: --steps "
                         "counts); config.yaml records the steps it resolves to", check="nat")
    batch_size: int = option(4, "rows per optimizer step (dpo, orpo: pairs; grpo: prompts, each sampled "
                             "group_size times; per micro-batch with --grad-accum)", check="pos",
                             label="batch size")
    seq_len: int = option(512, "tokens per row; longer examples are truncated", check="pos", label="seq len")
    lr: float = option(1e-4, "peak learning rate", check="pos", label="learning rate")
    optimizer: str = option("adamw", "from mlx.optimizers: adamw (Adam with decoupled weight decay), adam, "
                            "sgd, adafactor (factored second moments), lion (sign of momentum: use a 3-10x "
                            "smaller lr), muon (orthogonalised momentum on block matrices, AdamW on the rest)",
                            choices=OPTIMIZERS)
    warmup: int = option(0, "steps of linear warm-up from 0", check="nat")
    schedule: str = option("cosine", "learning-rate decay after warm-up", choices=SCHEDULES)
    min_lr: float = option(0.0, "where cosine / linear decay ends (in [0, lr])", check="nat")
    betas: list[float] = option([0.9, 0.999], "adamw, adam, lion (and muon's AdamW part) betas: two "
                                "comma-separated numbers in [0, 1)")
    eps: float = option(1e-8, "adamw, adam (and muon's AdamW part) epsilon", check="pos")
    momentum: float = option(0.9, "sgd, muon: momentum (sgd: 0 = none)", check="frac")
    nesterov: bool = option(False, "sgd, muon: Nesterov momentum")
    weight_decay: float = option(0.0, "weight decay (decoupled for adamw, lion, muon, adafactor; "
                                 "L2 for sgd; adam has none)", check="nat")
    grad_clip: float = option(1.0, "max global gradient norm; 0 = off", check="nat")
    nonfinite: str = option("stop", "a step whose loss or gradients are not finite is never applied: "
                            "stop the run (exit 1) or skip the step", choices=("stop", "skip"))
    grad_accum: int = option(1, "micro-batches per optimizer step", check="pos")
    grad_checkpoint: bool = option(False, "recompute each block in the backward pass (memory for time)")
    strict_memory: bool = option(False, "refuse to start a run whose estimated peak memory exceeds the "
                                 "machine's (default: warn, naming settings that fit)")
    dtype: str = option("auto", "compute dtype (auto: the backend's; float32 on CPU)", choices=DTYPES)
    qlora: str = option("auto", "keep the base quantized, every LoRA-targetable projection (QLoRA; auto: "
                        "on Metal/CUDA for a quantized file, on CPU when float32 would not fit in memory)",
                        choices=QLORA_MODES, methods=ADAPTER_METHODS)
    qlora_bits: int = option(4, "QLoRA: bits of the matrices quantized at load, 4 or 8 (Q4_0/Q4_1/Q8_0 "
                             "GGUF blocks keep their own)", check="pos", methods=ADAPTER_METHODS)
    qlora_group_size: int = option(32, "QLoRA: inputs per quantization group, 32 or 64", check="pos",
                                   methods=ADAPTER_METHODS)
    qlora_tables: bool = option(False, "QLoRA: quantize the embedding table and the output layer at load "
                                "too (else they stay as the file holds them: quantized if in Q4_0/Q4_1/Q8_0 "
                                "blocks, otherwise dense); less memory for a large vocabulary, some "
                                "accuracy on every token", methods=ADAPTER_METHODS)

    # LoRA
    lora_rank: int = option(8, "LoRA rank", check="pos", methods=ADAPTER_METHODS, label="lora rank")
    lora_alpha: float = option(16.0, "LoRA alpha (scale = alpha / rank)", check="pos", methods=ADAPTER_METHODS,
                               label="lora alpha")
    lora_dropout: float = option(0.0, "dropout on the LoRA input", check="frac", methods=ADAPTER_METHODS)
    lora_targets: list[str] = option(["q", "v"], f"comma-separated, from {','.join(LORA_TARGETS)}",
                                     choices=LORA_TARGETS, methods=ADAPTER_METHODS, label="lora targets",
                                     noun="LoRA target")
    lora_per_head_q: bool = option(False, "per-head Q LoRA (A_h, B_h per Q head)", methods=ADAPTER_METHODS)
    lora_layers: list[int] | None = option(None, "comma-separated block indices (negative from the end); "
                                           "default all", methods=ADAPTER_METHODS)

    # full fine-tuning: block weights always; these are opt-in
    train_embeddings: bool = option(False, "also train the token embeddings", methods=("full",))
    train_norm: bool = option(False, "also train the final norm", methods=("full",))
    train_output: bool = option(False, "also train the output (with tied embeddings: the shared table)",
                                methods=("full",))

    # from scratch: model shape (vocab comes from the tokenizer)
    arch: str = option("llama", "architecture (tiny: the reference TransformerLM, char tokenizer)",
                       choices=SUPPORTED_ARCHS, methods=("scratch",), noun="arch")
    d_model: int = option(256, "model width", check="pos", methods=("scratch",))
    n_layers: int = option(4, "blocks", check="pos", methods=("scratch",), label="layers")
    n_heads: int = option(4, "query heads", check="pos", methods=("scratch",), label="heads")
    n_kv_heads: int = option(4, "key/value heads (divides n_heads)", check="pos", methods=("scratch",))
    d_head: int = option(64, "width of one head", check="pos", methods=("scratch",))
    d_ff: int = option(688, "FFN hidden width", check="pos", methods=("scratch",))
    rope_base: float = option(10000.0, "RoPE base", check="pos", methods=("scratch",))
    norm_eps: float = option(1e-5, "RMSNorm epsilon", check="pos", methods=("scratch",))
    tie_embeddings: bool = option(True, "share the embedding table with the output", methods=("scratch",))
    init_scale: float = option(1.0, "matmul weights ~ N(0, init_scale / sqrt(fan_in))", check="pos",
                               methods=("scratch",))
    lens: str | None = option(None, "embed via this model's token table (frozen) @ a trained projection",
                              methods=("scratch",))

    # data
    data_split: str = option("train", "the split to train on (folders of tables, Hugging Face datasets); "
                             "a validation/valid/dev split evaluates, a test split scores accuracy")
    data_subset: str | None = option(None, "the dataset's subset (its configuration name)")
    text_column: str | None = option(None, "read this column as 'text'")
    prompt_column: str | None = option(None, "read this column as 'prompt'")
    completion_column: str | None = option(None, "read this column as 'completion'")
    messages_column: str | None = option(None, "read this column as 'messages' (a list of role/content)")
    chosen_column: str | None = option(None, "read this column as 'chosen' (preference pairs)")
    rejected_column: str | None = option(None, "read this column as 'rejected' (preference pairs)")
    answer_column: str | None = option(None, "read this column as 'answer' (grpo)")
    pack: bool = option(True, "several examples per row with a block-causal mask (--no-pack: padding)")
    mask_prompt: bool = option(True, "loss only on completions / assistant turns")
    chat_template_kwargs: dict[str, Any] = option({}, "further variables for the model's chat template, "
                                                  "as a YAML/JSON mapping, e.g. '{enable_thinking: false}' "
                                                  "(Qwen3); every rendering of the run gets them",
                                                  label="template args")
    valid_fraction: float = option(0.1, "held out when --data is a single file (seeded split)", check="frac")

    # the loop
    eval_every: int = option(50, "evaluate every N steps (0 = only at the end)", check="nat", label="eval every")
    early_stop: int = option(0, "stop when the validation loss has not improved for N evaluations "
                             "(0 = off); best/ always holds the lowest", check="nat", label="early stop")
    early_stop_delta: float = option(0.0, "the least drop in validation loss that counts as improving",
                                     check="nat")
    eval_batches: int = option(20, "validation batches per evaluation (-1 = all)", check="batches",
                               label="eval batches")
    sample_every: int = option(0, "generate samples every N steps (0 = never)", check="nat",
                               label="sample every")
    sample_prompts: list[str] = option([], "a prompt for sample generations (repeat the flag for more; "
                                       "default: the first validation prompts)")
    sample_tokens: int = option(48, "tokens per sample", check="pos")
    save_every: int = option(100, "checkpoint every N steps (0 = only at the end)", check="nat",
                             label="save every")
    keep_checkpoints: int = option(3, "newest N checkpoints kept (0 = all)", check="nat")
    report_to: list[str] = option([], "also stream the metrics to these dashboards (comma-separated: "
                                  "tensorboard (RUN/tensorboard), wandb; WANDB_MODE=offline keeps W&B local)",
                                  choices=DASHBOARDS, noun="dashboard", label="report to")
    taps_every: int = option(0, "activation taps every N steps (0 = never)", check="nat", label="taps every")
    seed: int = option(0, "RNG seed (data order, init, dropout)", check="nat")
    eval_accuracy: bool = option(False, "greedy exact-match accuracy on the test split, before and after")
    accuracy_examples: int = option(0, "test examples for --eval-accuracy (0 = all)", check="nat")

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
        if isinstance(self.reward_weights, str):
            self.reward_weights = [float(t) for t in self.reward_weights.split(",") if t.strip()]
        if isinstance(self.report_to, str):
            self.report_to = [t.strip() for t in self.report_to.split(",") if t.strip()]
        if isinstance(self.sample_prompts, str):
            self.sample_prompts = [self.sample_prompts]
        if isinstance(self.chat_template_kwargs, str):
            self.chat_template_kwargs = parse_mapping(self.chat_template_kwargs, "chat_template_kwargs")

    def validate(self) -> "TrainConfig":
        def bad(msg: str) -> UserError:
            return UserError(f"train config: {msg}")

        err = check_value("method", self.method)  # first: the other fields depend on it
        if err:
            raise bad(f"method {err}, got {self.method!r}")
        err = check_value("objective", self.objective)  # the objective-specific fields depend on it
        if err:
            raise bad(f"objective {err}, got {self.objective!r}")
        self.resolve_beta()
        for f in fields(self):
            if self.method not in f.metadata.get("methods", ALL_METHODS):
                continue  # e.g. lora_rank does not matter to a full fine-tune (given, `check_given` refuses it)
            value = getattr(self, f.name)
            err = check_value(f.name, value)
            if err:
                raise bad(err if err.startswith("unknown") else f"{f.name} {err}, got {value!r}")
            if self.objective not in f.metadata.get("objectives", OBJECTIVES) and value != field_default(f.name):
                raise bad(f"{f.name} applies to objective {' or '.join(f.metadata['objectives'])} only "
                          f"(the objective is {self.objective})")
        if self.warmup > self.steps:
            raise bad(f"warmup ({self.warmup}) is longer than the run (steps {self.steps})")
        if self.min_lr > self.lr:
            raise bad(f"min_lr must be in [0, lr], got {self.min_lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise bad(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.early_stop and not self.eval_every:
            raise bad("early_stop needs evaluations during the run (eval_every > 0)")
        if self.optimizer == "adam" and self.weight_decay:
            raise bad("adam has no weight decay (use adamw)")
        if self.nesterov and self.optimizer in ("sgd", "muon") and self.momentum <= 0:
            raise bad("nesterov needs momentum > 0")
        if self.adapters:
            if not self.lora_targets:
                raise bad("lora_targets is empty")
            if self.lora_per_head_q and "q" not in self.lora_targets:
                raise bad("lora_per_head_q needs 'q' in lora_targets")
        if self.method == "scratch" and self.n_heads % self.n_kv_heads:
            raise bad(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.lens and self.method != "scratch":
            raise bad("lens (a projection-lens warm start) needs method scratch")
        if not self.data_split.strip():
            raise bad("data_split is empty (e.g. train)")
        given_twice = sorted(set(self.chat_template_kwargs) & TEMPLATE_VARIABLES)
        if given_twice:
            raise bad(f"chat_template_kwargs may not set {given_twice[0]!r} (mlxtoy passes it to the "
                      f"template itself)")
        return self

    def resolve_beta(self) -> "TrainConfig":
        """beta, when not given, is the objective's default (BETA); its range is checked. Part of
        `validate` (config.yaml records what the run used); objectives take it resolved."""
        default_beta, beta_check = BETA[self.objective]
        if self.beta is None:
            self.beta = default_beta
        ok, why = CHECKS[beta_check]
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not ok(self.beta):
            raise UserError(f"train config: beta {why} for {self.objective}, got {self.beta!r}")
        return self

    @property
    def adapters(self) -> bool:
        """Trains adapters on a frozen base (LoRA, DoRA) rather than the weights themselves."""
        return self.method in ADAPTER_METHODS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "TrainConfig":
        if not isinstance(d, dict):
            raise UserError(f"{source}: expected a mapping of config keys, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        d = {k: v for k, v in d.items() if k != "run"}  # a run's config.yaml: resolved extras
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"{source}: unknown key {unknown[0]!r}")
        return cls(**{k: typed_value(k, v, source) for k, v in d.items()})

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


def check_given(cfg: "TrainConfig", given: Iterable[str]) -> None:
    """Options given explicitly (flags, YAML keys) that do not apply to the run's method are
    refused naming both, unless at their default (`--qlora on --method full` trained full
    float32 without a word). A config built in code stays lenient: shared test and form configs
    carry every field. An unknown method is left to the config's validation, which names it."""
    if cfg.method not in TRAIN_METHODS:
        return
    for name in given:
        if name not in TrainConfig.__dataclass_fields__:  # a run's config.yaml: its `run` facts
            continue
        methods = train_field(name).metadata.get("methods", ALL_METHODS)
        if cfg.method not in methods and getattr(cfg, name) != field_default(name):
            raise UserError(f"train config: {name} applies to method {' or '.join(methods)} only (the method "
                            f"is {cfg.method})")


# What a resume may change (the one rule: `resume_check`). FIXED: the shapes a checkpoint holds
# (weights, adapters, optimizer state): refused. STATE: what its data position, RNG and saved
# generation mean (which rows, in which order, how many a step, how many completions a prompt):
# named in a warning, since the continued run is no longer the uninterrupted one. Every other
# field (steps, lr, eval_every, ...) may change freely.
RESUME_FIXED = ("method", "objective", "arch", "lens", "model", "tokenizer", "lora_rank", "lora_targets",
                "lora_per_head_q", "lora_layers", "train_embeddings", "train_norm", "train_output", "d_model",
                "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff", "tie_embeddings", "optimizer")
RESUME_STATE = ("data", "data_split", "data_subset", "valid_fraction", "seed", "batch_size", "grad_accum",
                "seq_len", "pack", "group_size", "iterations_per_generation", "skip_zero_std_groups")


def resume_check(old: "TrainConfig", new: "TrainConfig") -> list[str]:
    """A resumed run's recorded config against the one it continues with: UserError for a
    changed FIXED field, a warning line for each changed STATE field."""
    for name in RESUME_FIXED:
        if getattr(new, name) != getattr(old, name):
            raise UserError(f"cannot change {name} when resuming ({getattr(old, name)!r} -> "
                            f"{getattr(new, name)!r}): the checkpoints hold what it shaped")
    return [f"resuming with {name} changed ({getattr(old, name)!r} -> {getattr(new, name)!r}): the run "
            f"continues, but no longer as the uninterrupted run would have"
            for name in RESUME_STATE if getattr(new, name) != getattr(old, name)]


# The sections of TrainConfig, in field order: (the section's first field, its title). `mlxtoy
# train --help` and docs/configuration.md group the flags by them; a field added to the class
# belongs to the section its place puts it in.
TRAIN_SECTIONS = (
    ("model", "what to train on"),
    ("reward", "grpo: rewards, sampling and the loss"),
    ("steps", "optimisation"),
    ("lora_rank", "LoRA and DoRA"),
    ("train_embeddings", "full fine-tuning (block weights always train; these are opt-in)"),
    ("arch", "from scratch: the model's shape"),
    ("data_split", "data"),
    ("eval_every", "the loop: evaluation, samples, checkpoints, dashboards"),
)


def train_sections() -> list[tuple[str, list[Field]]]:
    """TrainConfig's fields as (title, fields) in TRAIN_SECTIONS' order."""
    firsts = dict(TRAIN_SECTIONS)
    out: list[tuple[str, list[Field]]] = []
    for f in fields(TrainConfig):
        if f.name in firsts:
            out.append((firsts[f.name], []))
        if not out:
            raise KeyError(f"TrainConfig field {f.name!r} comes before the first section")
        out[-1][1].append(f)
    if len(out) != len(TRAIN_SECTIONS):
        raise KeyError("a TRAIN_SECTIONS first field is not a TrainConfig field in section order")
    return out


# what every chat-template render is given already (chat_template_kwargs may not set them)
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


def parse_mapping(text: str, what: str) -> dict[str, Any]:
    """A YAML (or JSON) mapping written as text, e.g. '{enable_thinking: false}'; '' is {}."""
    if not text.strip():
        return {}
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"{what}: not a YAML/JSON mapping ({getattr(e, 'problem', None) or e}): {text!r}") from None
    return check_mapping(value, what)


def check_mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise UserError(f"{what} must be a mapping of names to values, e.g. {{enable_thinking: false}}, "
                        f"got {value!r}")
    return dict(value)


def train_field(name: str) -> Field:
    for f in fields(TrainConfig):
        if f.name == name:
            return f
    raise KeyError(name)


MAX_INT = 2**31 - 1  # beyond any sensible count, and what MLX's int32 indices hold


def _field_type(name: str) -> tuple[type, type | None, bool]:
    """(base type, list item type or None, optional?) of TrainConfig field `name`."""
    tp = typing.get_type_hints(TrainConfig)[name]
    args = typing.get_args(tp)
    optional = type(None) in args
    if optional:
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is list:
        return list, typing.get_args(tp)[0], optional
    if typing.get_origin(tp) is dict:
        return dict, None, optional
    return tp, None, optional


def _scalar(item_type: type, v: Any, what: str) -> Any:
    if item_type is bool:
        if isinstance(v, bool):
            return v
        raise UserError(f"{what} must be true or false, got {v!r}")
    if isinstance(v, bool):
        raise UserError(f"{what} must be a number, got {v!r}")
    if item_type in (int, float) and isinstance(v, str):
        try:  # YAML reads `1e-4` (no dot) as a string
            v = float(v.strip()) if item_type is float else int(v.strip())
        except ValueError:
            kind = "a number" if item_type is float else "a whole number"
            raise UserError(f"{what} must be {kind}, got {v!r}") from None
    if item_type is int:
        if isinstance(v, float) and v.is_integer() and abs(v) <= MAX_INT:
            v = int(v)
        if not isinstance(v, int):
            raise UserError(f"{what} must be a whole number, got {v!r}")
        return v
    if item_type is float:
        if not isinstance(v, (int, float)):
            raise UserError(f"{what} must be a number, got {v!r}")
        return float(v)
    if not isinstance(v, str):
        raise UserError(f"{what} must be a string, got {v!r}")
    return v


def typed_value(name: str, value: Any, source: str = "config") -> Any:
    """A value from YAML / JSON / the TUI, checked against TrainConfig field `name`'s type
    (lists may be comma-separated strings; numbers written as strings are read as numbers)."""
    base, item, optional = _field_type(name)
    what = f"{source}: {name}"
    if value is None:
        if optional:
            return None
        raise UserError(f"{what} needs a value (got null)")
    if base is dict:
        return parse_mapping(value, what) if isinstance(value, str) else check_mapping(value, what)
    if base is list:
        if isinstance(value, str):
            value = [t.strip() for t in value.split(",") if t.strip()]
        elif item is int and isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list):
            raise UserError(f"{what} must be a list, got {value!r}")
        return [_scalar(item, v, what) for v in value]
    return _scalar(base, value, what)


def check_value(name: str, value: Any) -> str | None:
    """Why `value` is not valid for TrainConfig field `name` (None when it is), from the
    field's metadata: its choices (every item, for lists) and its range check."""
    meta = train_field(name).metadata
    choices = meta.get("choices")
    if choices:
        unknown = [item for item in (value if isinstance(value, list) else [value]) if item not in choices]
        if unknown:
            noun = meta.get("noun")
            if noun:  # every unknown item named, so one fix covers them all
                return f"unknown {noun} {', '.join(map(repr, unknown))} (choose from {','.join(choices)})"
            return f"must be one of {', '.join(choices)}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"must be at most {MAX_INT}"
    check = meta.get("check")
    if check and value is not None:
        ok, why = CHECKS[check]
        try:
            good = bool(ok(value)) and math.isfinite(value)
        except TypeError:
            return f"must be a number, got {value!r}"
        if not good:
            return why
    return None


def parse_text(name: str, text: str) -> tuple[Any, str | None]:
    """A form's text for TrainConfig field `name` -> (value, None) or (None, reason); never
    raises. Lists are comma-separated; the checks are `check_value`'s."""
    f = train_field(name)
    text = text.strip()
    default = field_default(name)
    if default is None:  # an optional field: read as its type says; empty is None (its default)
        if not text:
            return None, None
        base = _field_type(name)[0]
        default = [] if base is list else base() if base in (int, float, bool) else ""
    if isinstance(default, dict):
        try:
            return parse_mapping(text, name), None
        except UserError:
            return None, "not a YAML/JSON mapping, e.g. {enable_thinking: false}"
    if isinstance(default, list):
        value: Any = [t.strip() for t in text.split(",") if t.strip()]
        if not value:
            choices = f.metadata.get("choices") or ()
            return None, "name at least one" + (f" of {','.join(choices)}" if choices else "")
    elif not text:  # required, unless empty is the field's default (grpo's --reward under sft)
        return ("", None) if default == "" else (None, "required")
    elif isinstance(default, bool):
        low = text.lower()
        if low not in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            return None, f"{text!r} is not yes or no"
        value = low in ("true", "yes", "on", "1")
    elif isinstance(default, int):
        try:
            value = int(text)
        except ValueError:
            return None, f"{text!r} is not a whole number"
    elif isinstance(default, float):
        try:
            value = float(text)
        except ValueError:
            return None, f"{text!r} is not a number"
    else:
        value = text
    err = check_value(name, value)
    return (None, err) if err else (value, None)


def field_default(name: str) -> Any:
    f = train_field(name)
    return f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
