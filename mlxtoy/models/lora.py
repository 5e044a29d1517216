"""LoRA and DoRA adapters for the per-head Llama block.

A LoRA wrapper adds a low-rank update to a frozen base projection:
    y = base(x) + scale * B(A(dropout(x))),   scale = alpha / rank,
with A Gaussian and B zero, so at step 0 the model is exactly the base model.

DoRA (Liu et al. 2024) is the same wrapper with a trainable magnitude m (one per output row):
    W' = m * (W + scale * B @ A) / ||W + scale * B @ A||_row   (norm over the input axis),
m starting at ||W||_row (step 0 is the base). Computed without forming W': with
k = m / ||W + scale B A||_row, y = base(x) + (k - 1) * (x W^T) + k * scale * B(A(x)) (the bias
is not scaled, as in PEFT and mlx-lm). The norm is part of the gradient (PEFT and mlx-lm
detach it, the paper's shortcut); the forward is theirs.

Targets: q, k, v (per-head `HeadProjection`s, weight (H, Dh, D)), o, gate, up, down
(`nn.Linear`); any of them may be a quantized base (`mlxtoy.models.quant`: QLoRA). Two
flavours for q/k/v:
- standard: A (r, D), B (H*Dh, r), the adapter every exporter knows;
- per-head (the seed's Q adapter): per head h, A_h (r, D) and B_h (Dh, r), stored as
  A (H, r, D) and B (H, Dh, r) and computed as one batched matmul over the head axis.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxtoy.errors import UserError
from mlxtoy.models.llama import HeadProjection
from mlxtoy.models.quant import dequantize

# target name -> module path inside the shared Block (`mlxtoy.models.llama`); each spec
# (`mlxtoy.arch`) lists the targets its architecture has
TARGET_PATHS = {
    "q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.o",
    "gate": "ffn.gate", "up": "ffn.up", "down": "ffn.down",
}


# the trainable leaves of a wrapper (DoRA adds `magnitude`); checkpoints, exports and loading
# pick adapters by these names
ADAPTER_LEAVES = ("lora_a", "lora_b", "magnitude")


def _wide(dtype: mx.Dtype) -> mx.Dtype:
    """float16/bfloat16 -> float32 (norms are taken at least in float32); others unchanged."""
    return mx.float32 if dtype in (mx.float16, mx.bfloat16) else dtype


def dense_weight(module: nn.Module) -> mx.array:
    """A projection's weight as stored, a quantized one (QLoRA base) dequantized to float32;
    a per-head projection's in its (H, Dh, D) layout."""
    if isinstance(module, nn.QuantizedLinear):
        return dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
    if isinstance(module, HeadProjection):
        return module.dense_weight()
    return module.weight


def row_norms(w: mx.array) -> mx.array:
    """||w||_row over the last (input) axis, in at least float32: DoRA's magnitude at step 0."""
    w = w.astype(_wide(w.dtype))
    return mx.sqrt(mx.sum(w * w, axis=-1))


def dora_norm(w: mx.array, a: mx.array, b: mx.array, scale: float) -> mx.array:
    """||W + scale * B @ A||_row without forming the (out, in) sum:
    ||W||^2 + 2 scale rowsum(B * (W A^T)) + scale^2 rowsum((B A A^T) * B), batched over any
    leading axes (w (..., out, in), a (..., r, in), b (..., out, r) -> (..., out)). With B = 0
    this is `row_norms(w)` bit for bit, so a fresh DoRA is exactly the base."""
    dt = _wide(w.dtype)
    w, a, b = w.astype(dt), a.astype(dt), b.astype(dt)
    at = a.swapaxes(-1, -2)
    sq = (mx.sum(w * w, axis=-1) + (2 * scale) * mx.sum(b * (w @ at), axis=-1)
          + (scale * scale) * mx.sum((b @ (a @ at)) * b, axis=-1))
    return mx.sqrt(sq)


def _dora_out(y: mx.array, d: mx.array, k: mx.array, base: nn.Module) -> mx.array:
    """k * (x W^T + d) + bias from y = base(x), written so that k == 1 and d == 0 give y
    exactly (without a bias the backward keeps one activation, y + d, not two)."""
    k = k.astype(y.dtype)
    if "bias" not in base:
        return k * (y + d)
    return y + (k - 1) * (y - base.bias.astype(y.dtype)) + k * d


def standard_form(a: mx.array, b: mx.array) -> tuple[mx.array, mx.array]:
    """A per-head adapter (A (H, r, D), B (H, Dh, r)) as one: A (H*r, D), B (H*Dh, H*r) block-diagonal."""
    H, r, D = a.shape
    Dh = b.shape[1]
    eye = mx.eye(H, dtype=b.dtype)
    blocks = b[:, :, None, :] * eye[:, None, :, None]  # (H, Dh, H, r): head h's block at column block h
    return a.reshape(H * r, D), blocks.reshape(H * Dh, H * r)


def _gaussian_a(shape: tuple[int, ...], d_in: int) -> mx.array:
    # N(0, 1/d_in): the update's scale does not depend on the input width
    return mx.random.normal(shape) * (1.0 / math.sqrt(d_in))


class Adapter(nn.Module):
    """What both wrappers share: the frozen base, scale = alpha / rank, dropout on the input,
    the `disabled` switch, and the forward base(x) + delta(x), rescaled per output row by
    `dora_scale()` when the wrapper has a DoRA magnitude."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.disabled = False  # True: the base alone (DPO's reference; preference.adapters_disabled)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        if self.disabled:
            return y
        d = self.delta(x).astype(y.dtype)
        if "magnitude" not in self:
            return y + d
        return _dora_out(y, d, self.rescale(), self.base)

    def rescale(self) -> mx.array:
        """DoRA's rescale as the forward applies it: the constant a generation fixed for its
        tokens (`rescales_fixed`), else `dora_scale()` made now (training: its gradient flows)."""
        fixed = vars(self).get("mlxtoy_rescale")
        return fixed if fixed is not None else self.dora_scale()

    def factors(self) -> tuple[mx.array, mx.array]:
        """The update x A^T B^T as the fused decode block adds it (`fastmath.decode_block`'s
        low_rank): A (1, r, in) and B (1, out, r), float32, the scale in B (one slot, as a bank's)."""
        a, b = self.lora_a.astype(mx.float32), self.lora_b.astype(mx.float32)
        if a.ndim == 3:  # per head
            a, b = standard_form(a, b)
        return a[None], (self.scale * b)[None]


class LoRAHeadProjection(Adapter):
    """LoRA (or DoRA: `dora`) around a per-head projection; returns (B, T, H, Dh) like the base.
    DoRA's magnitude is one per output row, (H*Dh,) in head-major order."""

    def __init__(self, base: HeadProjection, rank: int, alpha: float, dropout: float = 0.0,
                 per_head: bool = False, dora: bool = False):
        super().__init__(base, rank, alpha, dropout)
        n_heads, d_head, d_in = base.n_heads, base.d_head, base.d_in
        self.per_head = per_head
        if per_head:
            self.lora_a = _gaussian_a((n_heads, rank, d_in), d_in)
            self.lora_b = mx.zeros((n_heads, d_head, rank))
        else:
            self.lora_a = _gaussian_a((rank, d_in), d_in)
            self.lora_b = mx.zeros((n_heads * d_head, rank))
        if dora:
            self.magnitude = row_norms(base.dense_weight()).reshape(-1)

    @property
    def n_heads(self) -> int:
        return self.base.n_heads

    @property
    def d_head(self) -> int:
        return self.base.d_head

    def delta(self, x: mx.array) -> mx.array:
        """The low-rank update (B, T, H, Dh), scale included."""
        if self.dropout is not None:
            x = self.dropout(x)
        H, Dh = self.n_heads, self.d_head
        a = self.lora_a.astype(x.dtype)
        b = self.lora_b.astype(x.dtype)
        if self.per_head:
            r = a.shape[1]
            u = x @ a.reshape(H * r, -1).T  # (..., H*r): every head's A_h in one GEMM
            lead = u.shape[:-1]
            u = u.reshape(-1, H, r).swapaxes(0, 1)  # (H, N, r)
            z = (u @ b.swapaxes(1, 2)).swapaxes(0, 1)  # (N, H, Dh): batched over heads
            return (self.scale * z).reshape(*lead, H, Dh)
        z = (x @ a.T) @ b.T
        return (self.scale * z).reshape(*x.shape[:-1], H, Dh)

    def dora_scale(self) -> mx.array:
        """DoRA's m / ||W + scale B A||_row, shaped (H, Dh)."""
        H, Dh = self.n_heads, self.d_head
        w = self.base.dense_weight()
        if self.per_head:  # per head: (Dh, D) + scale (Dh, r) @ (r, D), batched over H
            norm = dora_norm(w, self.lora_a, self.lora_b, self.scale)
        else:
            norm = dora_norm(w.reshape(H * Dh, -1), self.lora_a, self.lora_b, self.scale).reshape(H, Dh)
        return self.magnitude.reshape(H, Dh).astype(norm.dtype) / norm

    def delta_weight(self) -> mx.array:
        """scale * B @ A in the base's (H, Dh, D) layout."""
        if self.per_head:
            return self.scale * (self.lora_b @ self.lora_a)  # (H, Dh, r) @ (H, r, D)
        H, Dh = self.n_heads, self.d_head
        return (self.scale * (self.lora_b @ self.lora_a)).reshape(H, Dh, -1)

    def merged_weight(self) -> mx.array:
        """The adapted weight in the base's (H, Dh, D) layout and dtype."""
        return merged_weight(self, self.base.dense_weight())

    def merged(self) -> HeadProjection:
        w = self.base.dense_weight()
        out = HeadProjection(w.shape[2], w.shape[0], w.shape[1], bias="bias" in self.base)
        out.weight = self.merged_weight()
        if "bias" in self.base:
            out.bias = self.base.bias
        return out


class LoRALinear(Adapter):
    """LoRA (or DoRA: `dora`, magnitude (out,)) around an nn.Linear (or nn.QuantizedLinear):
    A (r, in), B (out, r)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0, dora: bool = False):
        super().__init__(base, rank, alpha, dropout)
        d_out, d_in = _linear_dims(base)
        self.lora_a = _gaussian_a((rank, d_in), d_in)
        self.lora_b = mx.zeros((d_out, rank))
        if dora:
            self.magnitude = row_norms(dense_weight(base))

    def delta(self, x: mx.array) -> mx.array:
        if self.dropout is not None:
            x = self.dropout(x)
        z = (x @ self.lora_a.astype(x.dtype).T) @ self.lora_b.astype(x.dtype).T
        return self.scale * z

    def dora_scale(self) -> mx.array:
        """DoRA's m / ||W + scale B A||_row, (out,); a quantized base is dequantized for the norm."""
        norm = dora_norm(dense_weight(self.base), self.lora_a, self.lora_b, self.scale)
        return self.magnitude.astype(norm.dtype) / norm

    def delta_weight(self) -> mx.array:
        return self.scale * (self.lora_b @ self.lora_a)

    def merged_weight(self) -> mx.array:
        """The adapted (out, in) weight, dense, in the base's dtype (dequantized's for QLoRA)."""
        return merged_weight(self, dense_weight(self.base))

    def merged(self) -> nn.Module:
        base = self.base
        w = self.merged_weight()
        d_out, d_in = w.shape
        out = nn.Linear(d_in, d_out, bias="bias" in base)
        out.weight = w
        if "bias" in base:
            out.bias = base.bias
        return out


def _linear_dims(layer: nn.Module) -> tuple[int, int]:
    if isinstance(layer, nn.QuantizedLinear):
        d_out, packed = layer.weight.shape
        return d_out, packed * 32 // layer.bits
    return layer.weight.shape


LORA_TYPES = (LoRAHeadProjection, LoRALinear)


def merged_weight(layer: nn.Module, w: mx.array) -> mx.array:
    """W + scale B A for a LoRA wrapper, m * that / its row norms for a DoRA one; `w` is the
    base's dense weight (its layout and dtype are kept; the sum is formed in >= float32)."""
    dt = _wide(w.dtype)
    v = w.astype(dt) + layer.delta_weight().astype(dt).reshape(w.shape)
    if "magnitude" in layer:
        v = v * (layer.magnitude.astype(dt).reshape(w.shape[:-1]) / row_norms(v))[..., None]
    return v.astype(w.dtype)


def is_dora(layer: nn.Module) -> bool:
    return isinstance(layer, LORA_TYPES) and "magnitude" in layer


def dora_adapters(model: nn.Module) -> list[Adapter]:
    """The model's DoRA adapters, in module order: each rescale a generation can fix."""
    return [m for _, m in model.named_modules() if is_dora(m)]


@contextmanager
def rescales_fixed(adapters: list[Adapter], rescales: list[mx.array]) -> Iterator[None]:
    """Inside, each of `adapters` applies its given rescale (`Adapter.rescale`), not one made
    again: a generation's tokens, for which the adapters' weights do not change, take the
    rescales made once (`dora_scale()`, which a 4-bit base's DoRA makes by dequantizing the whole
    matrix for its norm)."""
    for m, k in zip(adapters, rescales):
        object.__setattr__(m, "mlxtoy_rescale", k)
    try:
        yield
    finally:
        for m in adapters:
            object.__setattr__(m, "mlxtoy_rescale", None)


def resolve_layers(layers: Iterable[int] | None, n_layers: int) -> list[int]:
    """Block indices (negative counts from the end) -> sorted, checked, de-duplicated."""
    if layers is None:
        return list(range(n_layers))
    out = set()
    for i in layers:
        j = int(i) + n_layers if int(i) < 0 else int(i)
        if not 0 <= j < n_layers:
            raise UserError(f"lora_layers: block {i} does not exist (the model has {n_layers})")
        out.add(j)
    return sorted(out)


def apply_lora(model: nn.Module, targets: Iterable[str], rank: int, alpha: float,
               dropout: float = 0.0, per_head_q: bool = False,
               layers: Iterable[int] | None = None, paths: dict[str, str] | None = None,
               dora: bool = False) -> nn.Module:
    """Freeze `model` and wrap the targeted projections of the chosen blocks in LoRA (DoRA
    with `dora`).

    paths: target -> module path in a block (the spec's `lora_targets`; default the shared
    block's). Afterwards only the adapters (`lora_a`, `lora_b`, DoRA's `magnitude`) are
    trainable. Returns the model.
    """
    targets = list(targets)
    paths = paths or TARGET_PATHS
    for t in targets:
        if t not in TARGET_PATHS:
            raise UserError(f"unknown LoRA target {t!r} (choose from {', '.join(TARGET_PATHS)})")
    if rank <= 0:
        raise UserError(f"LoRA rank must be > 0, got {rank}")
    model.freeze()
    for i in resolve_layers(layers, len(model.layers)):
        block = model.layers[i]
        for t in targets:
            parent_name, _, name = paths.get(t, TARGET_PATHS[t]).rpartition(".")
            parent = getattr(block, parent_name)
            base = getattr(parent, name, None) if t in paths else None
            if base is None:  # e.g. gate on GPT-2 / the tiny LM (up -> GELU -> down)
                raise UserError(f"LoRA target {t!r}: this model ({model.config.arch}) has no "
                                f"{parent_name}.{name} projection")
            if isinstance(base, LORA_TYPES):
                raise UserError(f"LoRA target {t!r} listed twice")
            if isinstance(base, HeadProjection):
                wrapped = LoRAHeadProjection(base, rank, alpha, dropout, per_head=per_head_q and t == "q",
                                             dora=dora)
            else:
                wrapped = LoRALinear(base, rank, alpha, dropout, dora=dora)
            setattr(parent, name, wrapped)
    return model


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LORA_TYPES)]


def lora_parameters(model: nn.Module) -> dict[str, mx.array]:
    """Flat {name: array} of every adapter weight, e.g. `layers.0.attn.q.lora_a` (and DoRA's
    `layers.0.attn.q.magnitude`)."""
    return {k: v for k, v in tree_flatten(model.parameters())
            if k.endswith(tuple("." + leaf for leaf in ADAPTER_LEAVES))}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += scale * B @ A; DoRA: m * that / its row
    norms) and drop the wrappers."""
    for path, layer in lora_modules(model):
        parent_path, _, name = path.rpartition(".")
        parent = model
        for part in parent_path.split("."):
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        setattr(parent, name, layer.merged())
    mx.eval(model.parameters())
    return model


def lora_config_dict(targets, rank, alpha, dropout, per_head_q, layers, n_layers,
                     method: str = "lora") -> dict[str, Any]:
    return {
        "method": method, "targets": list(targets), "rank": int(rank), "alpha": float(alpha),
        "scale": float(alpha) / int(rank), "dropout": float(dropout),
        "per_head_q": bool(per_head_q), "layers": resolve_layers(layers, n_layers),
    }
