"""The weights a Llama block's fused step reads (`Block.fused_modules`, `fastmath.decode_block`):
an adapter's merged weight, a LoRA bank's base (its rows' updates added inside the kernel), a
plain matrix's lossless 4-/8-bit pack, kept on the block while its weights are the same arrays,
or a quantized base's 4-bit matrix as it is;
and the bytes they hold besides the weights (`decode_copies_bytes`, the memory estimate's)."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxtoy import routes
from mlxtoy.models import fastmath


def plain_projection(m: nn.Module) -> nn.Module:
    """The projection an active adapter wraps (one with a `merged_weight`, no dropout while
    training, not switched off) or a LoRA bank wraps (`banked`), or `m` itself: what the fused
    decode step reads."""
    if banked(m):
        return m.base
    base = getattr(m, "base", None)
    if base is None or not hasattr(m, "merged_weight") or getattr(m, "disabled", False):
        return m
    if getattr(m, "dropout", None) is not None and m.training:
        return m
    return base


def banked(m: nn.Module) -> bool:
    """Whether `m` is a bank of adapters read by rows (`mlxtoy.models.adapters`): the fused step
    reads its base and adds each row's update to the product (`added_updates`)."""
    return hasattr(m, "row_update")


def affine_kept(m: nn.Module) -> bool:
    """Whether `m` is a frozen quantized projection the fused step reads as it is (no float32 copy,
    no pack): MLX's affine layout, 4 or 8 bits in groups of 32, of a width and bits the kernels
    take here (`fastmath.affine_decode_ok`; a QLoRA base, a Q4_0 / Q4_1 / Q8_0 GGUF loaded
    quantized)."""
    bits = getattr(m, "bits", None)
    return ("scales" in m and bits in (4, 8) and getattr(m, "group_size", None) == 32
            and getattr(m, "mode", "affine") == "affine"
            and fastmath.affine_decode_ok(m.weight.shape[-1] * 32 // bits, bits))


def kernel_matrix(plain: nn.Module, heads: tuple[int, int] | None = None) -> mx.array | fastmath.AffineMatrix:
    """`plain`'s matrix as the fused step takes it: its weight, or an affine one as it is
    (`affine_kept`), its words shaped (heads, d_head, d_in * bits / 32) for a per-head projection
    (`heads`)."""
    if not affine_kept(plain):
        return plain.weight
    words = plain.weight if heads is None else plain.weight.reshape(*heads, -1)
    return fastmath.AffineMatrix(words, plain.scales, plain.biases, bool(getattr(plain, "symmetric", False)))


def added_in(m: nn.Module, plain: nn.Module) -> bool:
    """Whether the fused step adds `m`'s low-rank update to `plain`'s product inside the call
    (then DoRA's rescale) rather than reading one weight: a bank's rows' (`banked`), or a LoRA's or
    DoRA's around a quantized base's matrix (`affine_kept`; merged, it would be a float32 copy
    of that matrix)."""
    return banked(m) or (m is not plain and affine_kept(plain))


def added_updates(modules: list[tuple[nn.Module, nn.Module]]) -> tuple[
        dict[int, tuple[mx.array, mx.array, mx.array | None]], mx.array | None]:
    """The low-rank updates the fused step adds inside the call (`added_in`), as
    `fastmath.decode_block` takes them: {index in `modules`: (A (S, r, in), B (S, out, r), DoRA's
    rescale (S, out) or None: a bank's per slot, an adapter's `rescale()`)}, and the rows' slots
    (a bank's ids, (B,); None without a bank: every row one adapter's)."""
    updates = {}
    for i, (m, plain) in enumerate(modules):
        if m is not plain and added_in(m, plain):
            rescale = m.dora_k if "dora_k" in m else m.rescale().reshape(1, -1) if "magnitude" in m else None
            updates[i] = (*m.factors(), rescale)
    ids = next((m.rows.ids.astype(mx.int32) for m, _ in modules if banked(m)), None)
    return updates, ids


def merged_in(m: nn.Module, plain: nn.Module) -> bool:
    """Whether the fused step reads `m`'s merged weight (an adapter around `plain`)."""
    return m is not plain and not added_in(m, plain)


BLOCK_MATRICES = (1, 2, 3, 4, 6, 7, 8)  # the matrices among `Block.fused_weights` (the rest are norms)


def kept_packs(owner: nn.Module, weights: list[mx.array] | None, which: Sequence[int]) -> dict[str, mx.array]:
    """`fastmath.pack_lossless` of weights[i] for i in `which`, keyed str(i), kept on `owner`
    while the weights are the same arrays: the same objects, or equal values (tracing a compiled
    function hands a module new objects for the same weights). Each matrix packs or not on its
    own: a K-quant file mixes block types (a Q5_K_M's Q5_K matrices stay float32, its Q6_K ones
    beside them pack), and trying every matrix of trained weights costs ~10 ms for SmolLM2.
    What is kept always matches the weights last looked at, which `repin_packs` relies on;
    nothing for None weights or weights that do not pack."""
    if weights is None:
        object.__setattr__(owner, "mlxtoy_packs", None)
        return {}
    kept = vars(owner).get("mlxtoy_packs")
    if kept is not None and len(kept[0]) == len(weights) and all(
            a is b or (a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item())
            for a, b in zip(kept[0], weights)):
        object.__setattr__(owner, "mlxtoy_packs", (tuple(weights), kept[1]))
        return kept[1]
    packs = {}
    for i in which:
        packed = fastmath.pack_lossless(weights[i])
        if packed is not None:
            packs[str(i)] = packed
    object.__setattr__(owner, "mlxtoy_packs", (tuple(weights), packs) if packs else None)
    return packs


# the rows of a packed matrix the kernels' GEMV can take a pass for one row of x
ROW_PASSES = (1, 2, 4, 8)
# the most bytes of a form's packs a pass is timed on: past the caches, as a decode reads them,
# at a bounded cost (~20 ms a look at ~12 GB/s) for a model of any size
ROW_PASS_BYTES = 256 << 20


def row_pass_candidates(form: str, mats: list[mx.array], widths: list[int], passes: list[int]) -> dict[str, routes.Candidate]:
    """One candidate per rows a pass: one random row of x against each packed matrix (2-D, K
    = widths[i] weights a row), with the kernels set to that many rows a pass."""
    kernels = fastmath.kernels_module()
    rng = np.random.default_rng(0)  # not MLX's key: measuring must not move a run's randomness
    xs = {K: mx.array(rng.standard_normal((1, K), dtype=np.float32)) for K in set(widths)}
    mx.eval(list(xs.values()))

    def candidate(rows: int) -> routes.Candidate:
        def run() -> list[mx.array]:
            kernels.set_packed_row_pass(form, rows)
            ys = [kernels.gemv_packed(xs[K], p) for p, K in zip(mats, widths)]
            mx.eval(ys)
            return ys
        return run

    return {str(rows): candidate(rows) for rows in passes}


def choose_row_passes(layers: Sequence[nn.Module], packs: list[dict[str, mx.array]]) -> dict[str, int]:
    """Set how many rows of a packed matrix one row of x takes a pass (the kernels'
    `set_packed_row_pass`), for each pack form among these layers' decode packs (`decode_packs`):
    the faster on this machine, by timing the GEMV over the form's packs (up to ROW_PASS_BYTES)
    once per form and size class (`fastmath.route_table`). Several rows a pass keep several
    chains of FMAs going; one streams a row at a time: the Emerald Rapids read an 8-bit form 1.3x
    faster 4 rows a pass, the Zen 4 one row a pass. Every choice gives the same bits (each row's
    sum is its own chain). -> {form: rows}; {} where packs are unpacked (no kernels' passes)."""
    kernels = fastmath.kernels_module()
    by_form: dict[str, list[mx.array]] = {}
    widths: dict[str, list[int]] = {}
    size: dict[str, int] = {}  # the bytes of by_form[form]
    for layer, layer_packs in zip(layers, packs):
        packed = {i: p for i, p in layer_packs.items() if p.dtype == mx.uint8}
        weights = layer.fused_weights() if packed else None
        for i, p in packed.items():
            K = weights[int(i)].shape[-1]
            form = fastmath.PACK_FORMS[p.shape[-1] * 32 // K]
            if size.get(form, 0) < ROW_PASS_BYTES:
                by_form.setdefault(form, []).append(p.reshape(-1, p.shape[-1]))
                widths.setdefault(form, []).append(K)
                size[form] = size.get(form, 0) + p.nbytes
    table = fastmath.route_table()
    chosen: dict[str, int] = {}
    for form, mats in by_form.items():
        built_in = kernels.packed_row_pass(form)
        if not built_in:
            return {}
        names = [built_in] + [r for r in ROW_PASSES if r != built_in]
        key = (form, 1 << max(0, (size[form] >> 20) - 1).bit_length())  # (MiB, a power of two)
        route = table.kept_route("packed-row", key, [str(r) for r in names])
        if route is None:  # measured now (the random rows of x made only then)
            flops = 2.0 * sum(p.shape[0] * K for p, K in zip(mats, widths[form]))
            with mx.stream(mx.cpu):
                route = table.choose("packed-row", key, row_pass_candidates(form, mats, widths[form], names), flops,
                                     f"one row of x against {form} packs (~{key[1]} MiB): rows a pass")
        chosen[form] = int(route)
        kernels.set_packed_row_pass(form, chosen[form])
    return chosen


def decode_copies_bytes(model: nn.Module) -> int:
    """The bytes the fused decode step reads besides the weights (`Block.decode_packs`) while a
    model decodes: each adapted projection's merged float32 weight, held by the compiled decoder
    and once more while a prompt is prefilled, and the plain matrices' lossless packs (kept on
    the blocks; sized at the largest ratio the first block's matrices pack at, an upper bound
    where a file mixes block types). 0 where the fused step does not run (no kernels, other
    blocks)."""
    merged, plain, ratio = 0, 0, None
    ratios: list[float] = []  # the first fused block's plain matrices'
    for layer in getattr(model, "layers", []):
        modules = layer.fused_modules() if hasattr(layer, "fused_modules") else None
        if modules is None:
            continue
        with fastmath.inference():
            if not fastmath.decode_block_ok(mx.zeros((1, 1, 1)), *layer.fused_weights(modules)):
                continue
        for i in BLOCK_MATRICES:
            m, base = modules[i]
            if affine_kept(base):  # read as it is
                continue
            if merged_in(m, base):
                merged += base.weight.nbytes
                continue
            if ratio is None:
                packed = fastmath.pack_lossless(base.weight)
                ratios.append(0.0 if packed is None else packed.nbytes / base.weight.nbytes)
            plain += base.weight.nbytes
        if ratio is None and ratios:
            ratio = max(ratios)
    return 2 * merged + int((ratio or 0.0) * plain)


def repin_packs(owner: nn.Module, weights: list[mx.array] | None) -> None:
    """The packs kept on `owner` (`kept_packs`) now kept for these array objects of the same
    weights, without comparing values (right after a trace only)."""
    kept = vars(owner).get("mlxtoy_packs")
    if kept is not None and weights is not None:
        object.__setattr__(owner, "mlxtoy_packs", (tuple(weights), kept[1]))
