"""The memory guard: an estimate of a training step's peak memory, made before step 1 from
the real model and the run's shapes, compared with what the machine offers.

The estimate is a sum of parts, each from real shapes and byte sizes:

- weights: every parameter array of the model as loaded (frozen base, adapters, quantized
  scales), its actual bytes;
- trainable state: the gradients (the trainable arrays' bytes) and the optimizer's slots per
  trainable array (adamw / adam 2, sgd with momentum 1, lion 1, muon 1 on the blocks'
  matrices and 2 elsewhere, adafactor a row and a column vector per matrix); with mixed
  precision the low-precision copies of the trainable weights; with --grad-accum the summed
  gradients;
- activations: what the backward pass needs per block and per token (the residual stream
  twice, the q / k / v heads, the attention probabilities -- B x H x T x T, twice: MLX trains
  through its unfused attention on CPU and Metal; CUDA's fused backward may keep less, and the
  estimate is then high; none with the CPU kernels' block attention --, the gated FFN's three d_ff-wide
  tensors, and the inputs of the projections whose weights or adapters train), for every block
  at or after the first one that trains; with --grad-checkpoint only each block's input and
  output, plus one block recomputed in the backward pass;
- the logits over the vocabulary and their gradient (the loss keeps the softmax in float32).

The objective lays out the rows (`Objective.memory_rows`: GRPO's are batch x group rows of
its longest prompt plus the completion tokens) and the tokens whose logits the loss computes
(GRPO's: the completions' only).

The step's peak is the largest of three moments: the start of the backward pass (everything
above), the optimizer update (weights, optimizer state, gradients and the updated arrays),
and, for a step that samples before it trains (GRPO, `Objective.memory_decode`), the batched
decoding: weights, optimizer state, the decoder's KV cache (every row of the step's one
generation, its prompt and the room KVCache grows by) and what its fused blocks read besides
the weights (`decode_copies_bytes`: adapters merged, 4-bit packs), while no gradient or
activation is alive. 0.80-0.89 of MLX's measured peak on SmolLM2 GRPO runs (tests/test_memory.py,
within its 25%); the first generation also measures the routes of its new shapes, not counted.
The per-block and per-moment factors were measured on the compiled step (`Stepper`) with
`mx.get_peak_memory()`: within 10% on SmolLM2-135M for LoRA and full fine-tuning (README).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxtoy import backend, settings
from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.loading import planned_model
from mlxtoy.models.attention import attention_route
from mlxtoy.models.cache import KVCache, rounded_capacity
from mlxtoy.models.fastmath import kernels_on
from mlxtoy.models.fused_weights import decode_copies_bytes
from mlxtoy.models.quant import QUANTIZED_TYPES, QuantPlan
from mlxtoy.train.build import load_dtype, make_trainable, train_dtype
from mlxtoy.train.objectives import Objective, loss_logits_alive, make_objective, output_layer
from mlxtoy.train.step import block_matrix

GB = backend.GB
# calibration, measured on the compiled step (CPU, float32; see the module docstring)
BLOCKS_TRANSIENT = 1.5  # beyond the kept activations: the block being differentiated
# a recomputed block, its backward and its temporaries (fitted to measured peaks, with and
# without the CPU kernels: their blocks keep less, so one block is a smaller unit)
BLOCKS_TRANSIENT_CHECKPOINTED = {True: 4.2, False: 2.75}  # by whether the kernels are on
UPDATE_STATE_SHARE = 0.075  # the optimizer update's temporaries, as a share of its state
REFUSE_FACTOR = 2.0  # beyond this many times the machine's memory a run is refused outright
MEMORY_ENV = settings.MEMORY_GB.name  # overrides the machine's memory figure (leave room, tests)


@dataclass
class MemoryEstimate:
    """Bytes at a training step's peak, by part (see the module docstring)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    update: int  # the optimizer update's moment: weights, state, gradients, new arrays
    peak: int
    kv_cache: int = 0  # the batched decoder's cache, where the step samples (GRPO)
    generation: int = 0  # that decoding's moment: weights, optimizer state, the cache

    def describe(self) -> str:
        cache = f", kv cache {self.kv_cache / GB:.2f}" if self.kv_cache else ""
        return (f"{self.peak / GB:.2f} GB (weights {self.weights / GB:.2f}, gradients "
                f"{self.gradients / GB:.2f}, optimizer {self.optimizer / GB:.2f}, activations "
                f"{self.activations / GB:.2f}, logits {self.logits / GB:.2f}{cache})")


@dataclass
class MemoryCheck:
    """The estimate against the machine: what to print, and what would fit when it does not."""

    estimate: MemoryEstimate
    available: int | None
    source: str  # what `available` is: "physical memory", "Metal's recommended working set", ...
    suggestions: list[str]

    @property
    def fits(self) -> bool:
        return self.available is None or self.estimate.peak <= self.available

    def line(self) -> str:
        """The start-up line: the estimate and the machine's figure."""
        have = (f" of {self.available / GB:.1f} GB ({self.source})" if self.available else
                " (the machine's memory is unknown)")
        return f"memory: estimated peak {self.estimate.describe()}{have}"

    def warning(self) -> str:
        """Why it will not fit, and the settings that would (re-estimated)."""
        fix = ("; settings that fit: " + "; ".join(self.suggestions) if self.suggestions else
               "; nothing smaller fits (try a shorter --seq-len or a smaller model)")
        return (f"this run may not fit in memory: estimated peak {self.estimate.peak / GB:.2f} GB, "
                f"{self.source} {self.available / GB:.1f} GB{fix}")


def optimizer_bytes(cfg: TrainConfig, trainable: list[tuple[str, mx.array]]) -> int:
    """The optimizer state cfg.optimizer keeps for these trainable arrays (as mlx.optimizers
    lays it out: per array, in the array's dtype)."""
    total = 0
    for path, p in trainable:
        if cfg.optimizer in ("adamw", "adam"):
            total += 2 * p.nbytes
        elif cfg.optimizer == "sgd":
            total += p.nbytes if cfg.momentum > 0 else 0
        elif cfg.optimizer == "lion":
            total += p.nbytes
        elif cfg.optimizer == "muon":  # momentum on the blocks' matrices, AdamW on the rest
            total += p.nbytes if block_matrix(path, p) else 2 * p.nbytes
        elif cfg.optimizer == "adafactor":  # factored second moments: a row and a column
            if p.ndim >= 2:
                rows = math.prod(p.shape[:-1])
                cols = math.prod(p.shape[:-2]) * p.shape[-1]
                total += (rows + cols) * p.dtype.size
            else:
                total += p.nbytes
    return total


def _trains(module: nn.Module | None) -> bool:
    return module is not None and bool(tree_flatten(module.trainable_parameters()))


def _child(module: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        if not isinstance(module, nn.Module) or name not in module:
            return None
        module = module[name]
    return module if isinstance(module, nn.Module) else None


def _dense_trains(module: nn.Module | None) -> bool:
    """The module's own weight trains (full fine-tuning), not an adapter around it."""
    return module is not None and "weight" in module.trainable_parameters()


def block_attention(rows: int, cfg_model, T: int) -> bool:
    """Whether a step's attention takes the kernels' block form (`attention.attention_route`)."""
    m = cfg_model
    return attention_route(rows, m.n_heads, m.n_kv_heads, T, T, m.d_head, training=True, measure=False) == "block"


def attention_copies(rows: int, cfg_model, T: int) -> int:
    """(B, H, T, T) arrays a block keeps: none with the kernels' block attention (it keeps two
    floats a row and computes the probabilities again), else the softmax, and without the CPU
    kernels the masked scores too."""
    return 0 if block_attention(rows, cfg_model, T) else 1 if kernels_on() else 2


def block_elements(layer: nn.Module, cfg_model, T: int, rows: int = 1) -> int:
    """Elements one block keeps per token for the backward pass (T: the row length, `rows`
    of them a micro-batch)."""
    m = cfg_model
    d, q_w, kv_w = m.d_model, m.n_heads * m.d_head, m.n_kv_heads * m.d_head
    ffn = _child(layer, "ffn")
    gated = ffn is not None and "gate" in ffn
    # a gated FFN keeps gate and up outputs, and without the fused SwiGLU kernel act(gate) too
    kernels = kernels_on()
    n = (2 * d + q_w + 2 * kv_w + attention_copies(rows, m, T) * m.n_heads * T
         + (3 if gated and not kernels else 2) * m.d_ff)
    if any(_trains(_child(layer, f"attn.{p}")) for p in ("q", "k", "v")):
        n += d  # the normed input, for the q/k/v weights' (or adapters') gradients
    if _trains(_child(layer, "attn.o")):
        n += q_w
    if gated and (_trains(_child(ffn, "gate")) or _trains(_child(ffn, "up"))) or (
            not gated and _trains(ffn) and not _trains(_child(ffn, "down"))):
        n += d
    if gated and _trains(_child(ffn, "down")):
        n += m.d_ff
    return n


def checkpointed_elements(layer: nn.Module, cfg_model) -> int:
    """Elements a checkpointed block keeps per token: its input and output and, measured
    without the CPU kernels, the input and output gradient of each projection whose own
    weight trains (MLX forms those weight gradients late, so the recomputed inputs wait with
    them; with the kernels the measured peaks show no such wait)."""
    m = cfg_model
    d, q_w, kv_w = m.d_model, m.n_heads * m.d_head, m.n_kv_heads * m.d_head
    if kernels_on():
        return 2 * d
    widths = {"attn.q": (d, q_w), "attn.k": (d, kv_w), "attn.v": (d, kv_w), "attn.o": (q_w, d),
              "ffn.gate": (d, m.d_ff), "ffn.up": (d, m.d_ff), "ffn.down": (m.d_ff, d)}
    n = 2 * d
    inputs = set()
    for path, (w_in, w_out) in widths.items():
        if _dense_trains(_child(layer, path)):
            n += w_out
            inputs.add((path in ("attn.q", "attn.k", "attn.v"), path in ("ffn.gate", "ffn.up"), path, w_in))
    # q, k, v share their input, and so do gate and up
    seen = set()
    for qkv, gate_up, path, w_in in inputs:
        key = "qkv" if qkv else "gate_up" if gate_up else path
        if key not in seen:
            seen.add(key)
            n += w_in
    return n


def first_trained_block(model: nn.Module) -> int:
    """Blocks before this one need no backward pass (and keep nothing for it)."""
    if any(_trains(_child(model, name)) for name in ("tok_embeddings", "pos_embeddings", "lens")):
        return 0
    for i, layer in enumerate(model.layers):
        if _trains(layer):
            return i
    return len(model.layers)


def estimate(cfg: TrainConfig, model: nn.Module, objective: Objective | None = None) -> MemoryEstimate:
    """The peak memory of one training step of `model` under `cfg` (see the module docstring).

    What trains is read from the model (its trainable arrays), not from the method's name.
    `objective`: the run's (its rows, with cfg's batch size and length); built from cfg when
    not given."""
    m = model.config
    trainable = tree_flatten(model.trainable_parameters())
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    grads = sum(v.nbytes for _, v in trainable)
    opt = optimizer_bytes(cfg, trainable)
    act_dtype = train_dtype(cfg)
    item = act_dtype.size
    low_copies = 0  # mixed precision: the step casts the float32 masters down
    if act_dtype != mx.float32 and cfg.method in ("full", "scratch"):
        low_copies = sum(v.size for _, v in trainable) * item
    # rows and their length, as the objective lays out a micro-batch (a preference batch holds
    # pairs, two sequences each; GRPO's, group_size completions of each prompt)
    objective = objective or make_objective(replace(cfg).resolve_beta())
    rows, T = objective.memory_rows(cfg.batch_size, cfg.seq_len)
    tokens = rows * T
    first = first_trained_block(model)
    per_block = [block_elements(layer, m, T, rows) * tokens * item for layer in model.layers[first:]]
    widest = max(per_block, default=0)
    if cfg.grad_checkpoint:
        kept = sum(checkpointed_elements(layer, m) for layer in model.layers[first:]) * tokens * item
        acts = kept + int(BLOCKS_TRANSIENT_CHECKPOINTED[kernels_on()] * widest)
    else:
        acts = sum(per_block) + int(BLOCKS_TRANSIENT * widest)
    if per_block and block_attention(rows, m, T):  # the block attention's backward: p and ds of one layer, float32
        acts += 2 * rows * m.n_heads * T * T * 4
    # the loss: with the CPU kernels fused with the output projection (a chunk of tokens'
    # logits and float32 gradient at a time, every token's gradient when the output weight
    # trains); else measured as much as whole logits (compute dtype) with the float32 softmax
    # and exponentials, then their gradient; a reference forward inside the loss (DPO with
    # adapters) adds its logits
    output = output_layer(model)
    scored = objective.memory_loss_tokens(rows, T, output is not None)  # GRPO: the completions'
    if output is not None and kernels_on():
        trained = "weight" in output.trainable_parameters()
        logits = loss_logits_alive(scored, m.vocab_size, trained, isinstance(output, QUANTIZED_TYPES)) * 4
    else:
        logits = scored * m.vocab_size * (item + 8) + objective.memory_extra_logits(scored, m.vocab_size)
    accum = 2 * grads if cfg.grad_accum > 1 else 0  # the running sum and a micro-batch's
    kept = objective.memory_extra(grads)  # e.g. GRPO's reference weights for full fine-tuning
    backward = weights + kept + opt + low_copies + acts + logits + accum
    update = weights + kept + opt + 2 * grads + int(UPDATE_STATE_SHARE * opt) + (grads if cfg.grad_accum > 1 else 0)
    # a step that samples first (GRPO) decodes before its update: the gradients and
    # activations are not alive then, the decoder's cache is
    decode = objective.memory_decode(cfg.batch_size, cfg.grad_accum)
    cache = kv_cache_bytes(m, *decode, item) if decode else 0
    generation = weights + kept + opt + cache
    if decode:
        generation += decode_logits_bytes(decode[0], m.vocab_size) + decode_copies_bytes(model)
    return MemoryEstimate(weights=weights, gradients=grads, optimizer=opt, activations=acts,
                          logits=logits, update=update, peak=max(backward, update, generation),
                          kv_cache=cache, generation=generation)


def kv_cache_bytes(cfg_model, rows: int, prompt: int, generated: int, item: int) -> int:
    """The batched decoder's cache (`mlxtoy.engine`): per layer keys and values of every row,
    its buffers a whole number of KVCache.step positions (`rounded_capacity`)."""
    m = cfg_model
    positions = rounded_capacity(prompt + generated, KVCache.step)
    return 2 * m.n_layers * rows * m.n_kv_heads * m.d_head * positions * item


def decode_logits_bytes(rows: int, vocab: int) -> int:
    """A decode step's logits, float32, and the sampler's copy of them."""
    return 2 * rows * vocab * 4


def preflight(cfg: TrainConfig, quant: QuantPlan | None,
              check_shapes: Callable[[TrainConfig, nn.Module], None] | None = None,
              objective: Objective | None = None, measure: Callable[[], bool] | None = None) -> None:
    """The memory check from the model file's header, before anything is loaded: a run whose
    frozen weights alone exceed the machine's memory (certain not to fit), or that
    `check_memory` refuses, stops here with one error naming settings that fit, instead of
    being killed by the OS halfway through the load. `check_shapes` (the job's) runs first on
    the planned model, so a shape the model cannot take is the error named.

    Before the data is tokenized an objective's rows may be bounded loosely (GRPO's prompts by
    seq_len): where the check would refuse, `measure` (the job's: `Objective.memory_measure`
    on the data read) measures them, and the check runs again on what the data holds. Only a
    refusal pays for that tokenization."""
    if cfg.method == "scratch":
        return
    model = planned_model(cfg.model, load_dtype(cfg), quant if cfg.adapters else None)
    make_trainable(model, cfg)
    if check_shapes is not None:
        check_shapes(cfg, model)
    try:
        check = check_memory(cfg, model, objective)
    except UserError:
        if measure is None or not measure():
            raise
        check = check_memory(cfg, model, objective)
    if not check.fits and check.available and check.estimate.weights > check.available:
        raise UserError(check.warning().replace("this run may not fit", "this run does not fit")
                        + " (the model's weights alone exceed it)")


def largest_batch(cfg: TrainConfig, model: nn.Module, available: int, objective: Objective | None = None,
                  **kw) -> int:
    """The largest batch_size below cfg's whose estimate fits (0: none); the estimate grows
    with the batch, so a bisection."""
    lo, hi = 0, cfg.batch_size - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(replace(cfg, batch_size=mid, **kw), model, objective).peak <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo


def divisors(n: int) -> list[int]:
    """n's divisors, largest first."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]), reverse=True)


def suggestions(cfg: TrainConfig, model: nn.Module, available: int, objective: Objective | None = None) -> list[str]:
    """Settings that fit in `available` bytes, each re-estimated: a smaller batch, the same
    effective batch through --grad-accum, gradient checkpointing (alone or with a batch)."""
    def gb(**kw) -> str:
        return f"{estimate(replace(cfg, **kw), model, objective).peak / GB:.2f} GB"

    out: list[str] = []
    if cfg.adapters and not any(isinstance(m, QUANTIZED_TYPES) for _, m in model.named_modules()):
        quantized = planned_model(cfg.model, load_dtype(cfg), QuantPlan.of(cfg))
        make_trainable(quantized, cfg)
        peak = estimate(cfg, quantized, objective).peak
        if peak <= available:
            out.append(f"--qlora on ({peak / GB:.2f} GB)")
    b = largest_batch(cfg, model, available, objective)
    if b:
        out.append(f"--batch-size {b} ({gb(batch_size=b)})")
        # the same effective batch: a divisor of batch_size that fits, more micro-batches
        div = next((d for d in divisors(cfg.batch_size) if d <= b
                    and estimate(replace(cfg, batch_size=d, grad_accum=cfg.grad_accum * cfg.batch_size // d),
                                 model, objective).peak <= available), None)
        if div is not None:
            accum = cfg.grad_accum * cfg.batch_size // div
            out.append(f"--batch-size {div} --grad-accum {accum} (the same effective batch, "
                       f"{gb(batch_size=div, grad_accum=accum)})")
    if not cfg.grad_checkpoint:
        if estimate(replace(cfg, grad_checkpoint=True), model, objective).peak <= available:
            out.append(f"--grad-checkpoint ({gb(grad_checkpoint=True)})")
        else:
            b = largest_batch(cfg, model, available, objective, grad_checkpoint=True)
            if b:
                out.append(f"--grad-checkpoint --batch-size {b} ({gb(batch_size=b, grad_checkpoint=True)})")
    return out


def check_memory(cfg: TrainConfig, model: nn.Module, objective: Objective | None = None) -> MemoryCheck:
    """The estimate against the machine's memory; refuse (UserError) a run that will not fit
    with --strict-memory, or one beyond REFUSE_FACTOR times the machine's memory."""
    est = estimate(cfg, model, objective)
    available, source = backend.INFO.memory_budget()
    check = MemoryCheck(est, available, source, [])
    if check.fits:
        return check
    check.suggestions = suggestions(cfg, model, available, objective)
    if cfg.strict_memory or est.peak > REFUSE_FACTOR * available:
        why = "" if cfg.strict_memory else f" (over {REFUSE_FACTOR:g}x; --strict-memory refuses any excess)"
        raise UserError(check.warning().replace("this run may not fit", "this run does not fit") + why)
    return check


def smaller_settings(cfg: TrainConfig, quantized: bool) -> list[str]:
    """What to try when a step ran out of memory (`backend.out_of_memory_error`), each taking less
    than `cfg` does: half the batch (with twice the --grad-accum: the same effective batch),
    gradient checkpointing, a quantized base (`quantized`: the base is already), else a shorter
    sequence."""
    fixes = []
    if cfg.batch_size > 1:
        half = cfg.batch_size // 2
        same = (f" --grad-accum {cfg.grad_accum * 2} (the same effective batch)"
                if half * 2 == cfg.batch_size else "")
        fixes.append(f"--batch-size {half}{same}")
    if not cfg.grad_checkpoint:
        fixes.append("--grad-checkpoint")
    if cfg.adapters and not quantized:
        fixes.append("--qlora on")
    if not fixes:
        fixes.append(f"a shorter --seq-len than {cfg.seq_len}")
    return fixes


def set_cache_limit(check: MemoryCheck) -> str | None:
    """Where the model's memory is wired (Metal; the job wires it, `backend.wired_limit`): let
    MLX's buffer cache hold what the step leaves free of the memory budget. Elsewhere nothing is
    changed. Returns what was set, for the log."""
    if not backend.INFO.wired_memory or not check.available:
        return None
    cache = max(1 << 30, check.available - check.estimate.peak)
    try:
        mx.set_cache_limit(cache)
    except (RuntimeError, ValueError, AttributeError):
        return None
    return f"cache limit {cache / GB:.1f} GB"
