"""What an architecture is, as data: `ArchSpec`, its name table rows (`Tensor`), the tensor
transforms between our layout and Hugging Face's, and the metadata/config accessors that name
the missing field.

Our layout is GGUF's row order (llama.cpp's converter output) with q/k/v split per head: a
GGUF tensor is our parameter flattened (`fuse`), or several of ours concatenated by rows (GPT-2's
`attn_qkv`); reading splits it back (`split`). Hugging Face's layout differs from GGUF's by a
`Transform` per row of the table (llama's NEOX permute of q/k, GPT-2's Conv1D transpose, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from mlxtoy.errors import UserError
from mlxtoy.model_config import ModelConfig, metadata_number

REQUIRED = object()


@dataclass(frozen=True)
class Transform:
    """A re-layout from our (GGUF) rows to Hugging Face's and back. `rows` transforms permute
    rows only, so they also apply to a LoRA B (d_out, rank)."""

    to_hf: Callable[[mx.array, ModelConfig], mx.array]
    from_hf: Callable[[mx.array, ModelConfig], mx.array]
    rows: bool = True


def neox_to_interleaved(w: mx.array, n_heads: int) -> mx.array:
    """HF half-split rows -> GGML adjacent-pair rows, per head (works for weights and biases)."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def interleaved_to_neox(w: mx.array, n_heads: int) -> mx.array:
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def neox(heads: str) -> Transform:
    """llama's q/k: GGUF stores rows for GGML's adjacent-pair RoPE, HF the half-split (NEOX)
    form; `heads` names the config field with the head count ("n_heads" / "n_kv_heads")."""
    return Transform(lambda w, c: interleaved_to_neox(w, getattr(c, heads)),
                     lambda w, c: neox_to_interleaved(w, getattr(c, heads)))


# transformers' Conv1D stores (in, out); a 1-D bias is unchanged
TRANSPOSE = Transform(lambda w, c: w.T, lambda w, c: w.T, rows=False)


@dataclass(frozen=True)
class Tensor:
    """One row of an architecture's name table.

    ours: our parameter leaves (per block when `block`, e.g. "attn.q.weight"); several when the
    outside formats fuse them by rows (in this order). gguf / hf: the names outside (per block
    without the prefix; None when that format has no such tensor). hf_transform: HF layout <->
    ours. A row is used when all of its `ours` are parameters of the model (biases, untied
    output and q/k norms come and go with the config)."""

    ours: tuple[str, ...]
    gguf: str | None
    hf: str | None
    hf_transform: Transform | None = None
    block: bool = True


def row(ours: str | tuple[str, ...], gguf: str | None, hf: str | None,
        hf_transform: Transform | None = None, block: bool = True) -> Tensor:
    return Tensor((ours,) if isinstance(ours, str) else tuple(ours), gguf, hf, hf_transform, block)


class Fields:
    """Read access to a GGUF metadata dict (keys under `prefix`) or an HF config.json that
    names the missing field in its one-line error."""

    def __init__(self, values: dict[str, Any], prefix: str, where: str, noun: str):
        self.values, self.prefix, self.where, self.noun = values, prefix, where, noun

    def __contains__(self, key: str) -> bool:
        return self.prefix + key in self.values and self.values[self.prefix + key] is not None

    def __call__(self, key: str, default: Any = REQUIRED) -> Any:
        if key in self:
            return self.values[self.prefix + key]
        if default is REQUIRED:
            raise UserError(f"{self.where}: missing {self.noun} {self.prefix}{key}")
        return default

    def count(self, key: str, default: Any = REQUIRED, minimum: int = 1) -> int:
        """A whole number >= minimum (a stranger's file may hold 0, -1, "abc" or 1e30)."""
        return metadata_number(self(key, default), f"{self.where}: {self.noun} {self.prefix}{key}",
                               int, minimum)

    def positive(self, key: str, default: Any = REQUIRED) -> float:
        """A finite number > 0 (epsilons, RoPE bases, scales)."""
        return metadata_number(self(key, default), f"{self.where}: {self.noun} {self.prefix}{key}", float)


@dataclass(frozen=True)
class ArchSpec:
    """Everything mlxtoy knows about one architecture.

    model: the module class (`model(cfg)`); expected shapes come from it, built lazily.
    tensors: the name table. lora_targets: target name -> module path inside a block.
    gguf_arch: llama.cpp's `general.architecture` (None: no llama.cpp equivalent; `no_gguf` says
    why); gguf_in(fields, raw metadata) -> ModelConfig keywords; gguf_out(cfg) -> key suffix ->
    value (written under `gguf_arch.`). hf_classes / hf_model_types: what config.json names;
    hf_in(fields, raw) -> ModelConfig keywords; hf_out(cfg) -> config.json (None: no HF
    equivalent). hf_block: the per-block name prefix; hf_prefix: a prefix some checkpoints omit
    (GPT-2's "transformer."). check_gguf / check_hf: refuse what the format cannot express.
    adapters: whether LoRA adapter formats (adapter GGUF, PEFT, mlx-lm) are written.
    rope_freqs: whether llama.cpp reads a `rope_freqs` tensor for this architecture.
    fix_config(cfg, {our param: shape in the file}): settle what the tensors say (GPT-2's
    context is its position table). tokenizer: the default tokenizer source ("char").
    scratch: the ModelConfig fields the architecture fixes for a model trained from scratch
    (RoPE layout, q/k norm, ...), so it exports as that architecture.
    gguf_extra_in(cfg, read) / gguf_extra_out(cfg) -> {name: float32 array}: GGUF tensors that
    are config, not parameters (Phi-3's LongRoPE factors); `read(name)` is None when absent.
    """

    name: str
    model: type
    tensors: tuple[Tensor, ...]
    lora_targets: dict[str, str]
    gguf_arch: str | None = None
    gguf_in: Callable[[Fields, dict], dict] | None = None
    gguf_out: Callable[[ModelConfig], dict[str, Any]] | None = None
    hf_classes: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    hf_in: Callable[[Fields, dict], dict] | None = None
    hf_out: Callable[[ModelConfig], dict[str, Any]] | None = None
    hf_block: str = "model.layers.{i}."
    hf_prefix: str = ""
    check_gguf: Callable[[ModelConfig], None] | None = None
    check_hf: Callable[[ModelConfig], None] | None = None
    adapters: bool = True
    rope_freqs: bool = False
    no_gguf: str = ""
    fix_config: Callable[[ModelConfig, dict[str, tuple[int, ...]]], None] | None = None
    gguf_extra_in: Callable[[ModelConfig, Callable[[str], Any]], None] | None = None
    gguf_extra_out: Callable[[ModelConfig], dict[str, Any]] | None = None
    tokenizer: str | None = None
    scratch: dict[str, Any] | None = None

    def tensor_of(self, leaf: str) -> tuple[Tensor, int]:
        """The row holding our per-block leaf, and the leaf's index among the row's parts."""
        for t in self.tensors:
            if leaf in t.ours:
                return t, t.ours.index(leaf)
        raise KeyError(leaf)


# --------------------------------------------------------------------------- layout helpers

def flat_shape(param: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Our shape -> the fused (GGUF numpy) shape: per-head (H, Dh, D) -> (H*Dh, D), per-head
    bias (H, Dh) -> (H*Dh,); anything else unchanged."""
    if len(shape) == 3:
        return (shape[0] * shape[1], shape[2])
    if param.endswith(".bias") and len(shape) == 2:
        return (shape[0] * shape[1],)
    return shape


def fuse(parts: list[mx.array], params: list[str]) -> mx.array:
    """Our parameters -> one tensor in GGUF numpy shape (rows concatenated in order)."""
    flat = [p.reshape(flat_shape(n, tuple(p.shape))) for p, n in zip(parts, params)]
    return flat[0] if len(flat) == 1 else mx.concatenate(flat, axis=0)


def split(w: Any, params: list[str], shapes: dict[str, tuple[int, ...]], name: str,
          where: str) -> list[Any]:
    """One tensor in GGUF numpy shape -> our parameters (numpy or MLX in, same out)."""
    flats = [flat_shape(p, shapes[p]) for p in params]
    rows = sum(f[0] for f in flats)
    want = [rows, *flats[0][1:]]
    if list(w.shape) != want or any(f[1:] != flats[0][1:] for f in flats):
        raise UserError(f"{where}: tensor {name} has shape {list(w.shape)}, expected {want}")
    out, start = [], 0
    for p, f in zip(params, flats):
        out.append(w[start:start + f[0]].reshape(shapes[p]))
        start += f[0]
    return out


def rope_kind(cfg: ModelConfig) -> str | None:
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("type") or scaling.get("rope_type")
    return None if kind in (None, "none", "default") else kind


def expand(spec: ArchSpec, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
           fmt: str) -> list[tuple[str, list[str], Tensor]]:
    """(outside name, our parameters, row) for every tensor of the model in format `fmt`
    ("gguf" or "hf"), in llama.cpp's converter order: the global rows listed before the first
    block row, the blocks, then the other global rows. Rows whose parameters the model lacks
    (no biases, tied output) are left out."""
    rows = [t for t in spec.tensors if getattr(t, fmt)]
    first = next((k for k, t in enumerate(rows) if t.block), len(rows))
    block_prefix = "blk.{i}." if fmt == "gguf" else spec.hf_block
    items = [(t, -1) for t in rows[:first] if not t.block]
    items += [(t, i) for i in range(cfg.n_layers) for t in rows if t.block]
    items += [(t, -1) for t in rows[first:] if not t.block]
    out = []
    for t, i in items:
        name = getattr(t, fmt)
        if t.block:
            name, params = block_prefix.format(i=i) + name, [f"layers.{i}.{o}" for o in t.ours]
        else:
            params = list(t.ours)
        if all(p in shapes for p in params):
            out.append((name, params, t))
    covered = {p for _, params, _ in out for p in params}
    uncovered = [p for p in shapes if p not in covered]
    if uncovered:  # a spec whose table misses a module parameter: a bug, said plainly
        raise UserError(f"{spec.name}: parameter {uncovered[0]} has no {fmt.upper()} name")
    return out


def block0_name(spec: ArchSpec, leaf: str, fmt: str) -> str | None:
    """Layer 0's outside name of the row holding our per-block `leaf` (None: no such row)."""
    try:
        t, _ = spec.tensor_of(leaf)
    except KeyError:
        return None
    name = getattr(t, fmt)
    if name is None:
        return None
    return ("blk.0." if fmt == "gguf" else spec.hf_block.format(i=0)) + name
