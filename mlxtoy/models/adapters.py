"""Many adapters on one base, in one batch: each row of a batch reads its own adapter.

`attach_adapters` wraps every projection that any of the adapters targets in an
`AdapterBank`: the base projection (dense or quantized, computed once for all rows) and the
adapters' low-rank factors stacked by slot, slot 0 all zeros (the base alone). Row b's
update is gathered by its slot, `AdapterRows.ids[b]`, which whoever batches sets
(`mlxtoy.engine`; `adapter_rows_set`):
    y_b = base(x_b) + x_b A[s_b]^T B[s_b]^T          (scale folded into B)
Ranks differ between runs: the smaller ones are zero-padded (the extra columns add exact
zeros). A per-head q adapter (A (H, r, D), B (H, Dh, r)) enters in the standard form: A
stacked over the heads, B block-diagonal (the same product). DoRA's rescale at inference,
m / ||W + scale B A||_row, is a constant per adapter, kept per slot (1 for LoRA slots).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from mlxtoy.errors import UserError
from mlxtoy.models.lora import TARGET_PATHS, dense_weight, dora_norm, standard_form


class AdapterRows:
    """Each row's adapter slot, shared by the banks of one model (a plain object, not a
    module member: which adapters rows read is not part of the model's parameters)."""

    def __init__(self) -> None:
        self.ids = mx.zeros((1,), dtype=mx.int32)


def adapter_slots(model) -> AdapterRows | None:
    """The model's AdapterRows when it serves several adapters, else None."""
    return getattr(model, "adapter_rows", None)


@contextmanager
def adapter_rows_set(model, ids: mx.array | None) -> Iterator[None]:
    """Rows read the adapters in `ids` (B,) while inside (nothing to do for None or a model
    without banks); the previous ids are restored after (a compiled trace sets traced ones)."""
    rows = adapter_slots(model)
    if rows is None or ids is None:
        yield
        return
    before = rows.ids
    rows.ids = ids
    try:
        yield
    finally:
        rows.ids = before


class AdapterBank(nn.Module):
    """A base projection with N adapters stacked (slot 0: none). lora_a (N+1, r, in),
    lora_b (N+1, out, r) with each adapter's scale folded in; dora_k (N+1, out) or absent."""

    def __init__(self, base: nn.Module, lora_a: mx.array, lora_b: mx.array, dora_k: mx.array | None,
                 rows: AdapterRows):
        super().__init__()
        self.base = base
        self.lora_a, self.lora_b = lora_a, lora_b
        if dora_k is not None:
            self.dora_k = dora_k
        self.rows = rows
        self.freeze()

    def factors(self) -> tuple[mx.array, mx.array]:
        """The slots' updates as the fused decode block adds them to each row's product
        (`fastmath.decode_block`'s low_rank, the rows' slots its ids): A (S, r, in), B (S, out, r),
        float32 (a DoRA bank's rescale, `dora_k`, then multiplies the sum)."""
        return self.lora_a.astype(mx.float32), self.lora_b.astype(mx.float32)

    def row_update(self, x: mx.array) -> mx.array:
        """Each row's low-rank update x_b A[s_b]^T B[s_b]^T, (B, T, out) for x (B, ..., in) (out
        flattened for a per-head projection): all a LoRA bank adds to the base's product."""
        ids = self.rows.ids
        a = self.lora_a[ids].astype(x.dtype)  # (B, r, in)
        b = self.lora_b[ids].astype(x.dtype)  # (B, out, r)
        xf = x.reshape(x.shape[0], -1, x.shape[-1])  # (B, T, in)
        return (xf @ a.swapaxes(1, 2)) @ b.swapaxes(1, 2)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        ids = self.rows.ids
        lead = x.shape[:-1]
        d = self.row_update(x).reshape(y.shape).astype(y.dtype)
        if "dora_k" not in self:
            return y + d
        k = self.dora_k[ids].astype(y.dtype).reshape((ids.shape[0],) + (1,) * (len(lead) - 1) + y.shape[len(lead):])
        if "bias" not in self.base:
            return k * (y + d)
        bias = self.base.bias.astype(y.dtype)
        return y + (k - 1) * (y - bias) + k * d


def _module(root: nn.Module, path: str) -> tuple[nn.Module, str, nn.Module]:
    parent_path, _, name = path.rpartition(".")
    parent = root
    for part in parent_path.split("."):
        parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
    return parent, name, getattr(parent, name)


def attach_adapters(model: nn.Module, adapters: list[tuple[str, dict[str, mx.array], dict]]) -> AdapterRows:
    """Wrap `model`'s targeted projections so rows can read any of `adapters` [(name, weights,
    layout)] (as `loading.adapter_weights` gives them: `layers.0.attn.q.lora_a` ..., layout
    with scale and method); adapter i is slot i + 1. Returns the model's AdapterRows (also
    `model.adapter_rows`)."""
    rows = AdapterRows()
    modules: dict[str, list] = {}
    for slot, (name, weights, layout) in enumerate(adapters, start=1):
        for key in weights:
            path, _, leaf = key.rpartition(".")
            if leaf not in ("lora_a", "lora_b", "magnitude"):
                raise UserError(f"adapter {name}: unexpected tensor {key}")
            if path.split(".")[-1] not in {p.split(".")[-1] for p in TARGET_PATHS.values()}:
                raise UserError(f"adapter {name}: {key} is not a projection an adapter can target")
            modules.setdefault(path, [None] * len(adapters))[slot - 1] = (name, weights, layout)
    for path, per_slot in sorted(modules.items()):
        try:
            parent, attr, base = _module(model, path)
        except (AttributeError, IndexError, KeyError):
            raise UserError(f"adapter {next(p for p in per_slot if p)[0]}: the base has no {path}") from None
        dora = any(e is not None and path + ".magnitude" in e[1] for e in per_slot)
        w = dense_weight(base) if dora else None  # (H, Dh, D) for a per-head projection
        dims = set()
        factors = []
        for entry in per_slot:
            if entry is None:
                factors.append(None)
                continue
            name, weights, layout = entry
            a, b = weights[path + ".lora_a"].astype(mx.float32), weights[path + ".lora_b"].astype(mx.float32)
            scale = float(layout.get("scale", 1.0))
            k = None
            if path + ".magnitude" in weights:
                norm = dora_norm(w if a.ndim == 3 else w.reshape(-1, w.shape[-1]), a, b, scale)
                k = weights[path + ".magnitude"].astype(mx.float32).reshape(-1) / norm.reshape(-1)
            if a.ndim == 3:
                a, b = standard_form(a, b)
            dims.add((b.shape[0], a.shape[1]))
            if len(dims) > 1:
                raise UserError(f"adapter {name}: {path} is {b.shape[0]} x {a.shape[1]}, another adapter's "
                                f"is {' and '.join(f'{o} x {i}' for o, i in dims)}: they were trained on different models")
            factors.append((a, b * scale, k))
        out_dim, in_dim = dims.pop()
        rank = max(f[0].shape[0] for f in factors if f is not None)
        lora_a = mx.zeros((len(per_slot) + 1, rank, in_dim))
        lora_b = mx.zeros((len(per_slot) + 1, out_dim, rank))
        dora_k = mx.ones((len(per_slot) + 1, out_dim)) if dora else None
        for slot, f in enumerate(factors, start=1):
            if f is None:
                continue
            a, b, k = f
            lora_a[slot, :a.shape[0]] = a
            lora_b[slot, :, :a.shape[0]] = b
            if k is not None:
                dora_k[slot] = k
        setattr(parent, attr, AdapterBank(base, lora_a, lora_b, dora_k, rows))
    object.__setattr__(model, "adapter_rows", rows)
    mx.eval(model.parameters())
    return rows
