"""Activation taps: capture `attn_norm`, `ffn_out`, `resid_post` of every block (and per-head
views), summarise them, save them, and compare two models layer by layer.

The model fills a taps dict only when one is passed, so with taps off there is no extra work.
During training, taps are a separate forward pass over a fixed probe text every K steps.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

import mlx.core as mx
import numpy as np

from mlxtoy.errors import UserError
from mlxtoy.events import TapsEvent
from mlxtoy.fsutil import atomic_path
from mlxtoy.models.llama import TAP_SITES

HEAD_SITES = ("attn_entropy", "head_out_norm")
HIST_BINS = 16


def _check_request(model, sites: Iterable[str] | None, layers: Iterable[int] | None):
    n_layers = len(model.layers)
    sites = tuple(sites) if sites else TAP_SITES
    for s in sites:
        if s not in TAP_SITES:
            raise UserError(f"unknown tap site {s!r} (sites: {', '.join(TAP_SITES)})")
    if layers is not None:
        layers = sorted(set(int(i) for i in layers))
        for i in layers:
            if not 0 <= i < n_layers:
                raise UserError(f"layer {i} out of range (the model has layers 0..{n_layers - 1})")
    return sites, layers


def capture(model, tokens: mx.array, sites: Iterable[str] | None = None,
            layers: Iterable[int] | None = None, heads: bool = False) -> dict[tuple[int, str], mx.array]:
    """One forward pass over tokens (B, T) -> {(layer, site): activation (B, T, d_model)}.

    With heads=True also {(layer, "attn_entropy"): (H,), (layer, "head_out_norm"): (H,)}.
    """
    sites, layers = _check_request(model, sites, layers)
    request: dict[Any, Any] = {"_heads": heads}
    if layers is not None:
        request["_layers"] = set(layers)
    model.hidden(tokens, taps=request)
    out = {k: v for k, v in request.items() if isinstance(k, tuple)
           and (k[1] in sites or (heads and k[1] in HEAD_SITES))}
    mx.eval(out)
    return out


def tap_stats(x: mx.array, bins: int = HIST_BINS) -> dict[str, Any]:
    """mean, RMS, max |x|, share of near-zero values (|x| < 1% of the RMS) and a histogram."""
    a = np.asarray(x.astype(mx.float32)).ravel()
    rms = float(np.sqrt(np.mean(a * a)))
    max_abs = float(np.abs(a).max()) if a.size else 0.0
    edge = max_abs if max_abs > 0 else 1.0
    hist, edges = np.histogram(a, bins=bins, range=(-edge, edge))
    return {
        "mean": float(a.mean()),
        "rms": rms,
        "max_abs": max_abs,
        "zero_frac": float(np.mean(np.abs(a) < 0.01 * rms)) if rms > 0 else 1.0,
        "hist": hist.tolist(),
        "hist_edges": [float(edges[0]), float(edges[-1])],
    }


def summarize(taps: dict[tuple[int, str], mx.array]) -> tuple[list[dict], list[dict]]:
    """-> (site stats, per-head stats) in the `taps` event format."""
    stats, heads = [], []
    for (layer, site), value in sorted(taps.items()):
        if site in HEAD_SITES:
            heads.append({"layer": layer, "site": site, "values": np.asarray(value).tolist()})
        else:
            stats.append({"layer": layer, "site": site, **tap_stats(value)})
    return stats, heads


def drift(a: dict[tuple[int, str], mx.array], b: dict[tuple[int, str], mx.array]) -> list[dict]:
    """Relative L2 difference ||a - b|| / ||a|| per (layer, site) present in both."""
    common = sorted(k for k in a if k in b and k[1] in TAP_SITES)
    if not common:
        raise UserError("the two tap sets have no (layer, site) in common")
    out = []
    for key in common:
        x, y = a[key].astype(mx.float32), b[key].astype(mx.float32)
        if x.shape != y.shape:
            raise UserError(f"layer {key[0]} {key[1]}: shapes differ ({list(x.shape)} vs {list(y.shape)}); "
                            "the taps come from different architectures or prompts")
        num = mx.sqrt(mx.sum((x - y) ** 2)).item()
        den = mx.sqrt(mx.sum(x * x)).item()
        out.append({"layer": key[0], "site": key[1], "drift": num / den if den > 0 else float(num > 0)})
    return out


def model_signature(model) -> dict[str, Any]:
    cfg = model.config
    return {"arch": cfg.arch, "n_layers": cfg.n_layers, "d_model": cfg.d_model,
            "n_heads": cfg.n_heads, "vocab_size": cfg.vocab_size}


def save_taps(path: str, taps: dict[tuple[int, str], mx.array], model, tokens: list[int]) -> None:
    arrays = {f"layers.{layer}.{site}": v for (layer, site), v in taps.items()}
    meta = {"signature": json.dumps(model_signature(model)), "tokens": json.dumps(tokens)}
    with atomic_path(path, suffix=".safetensors") as tmp:  # mx.save_safetensors wants the ending
        mx.save_safetensors(tmp, arrays, metadata=meta)


def load_taps(path: str, model=None) -> tuple[dict[tuple[int, str], mx.array], dict[str, Any], list[int]]:
    try:
        arrays, meta = mx.load(path, return_metadata=True)
        signature = json.loads(meta["signature"])
        tokens = json.loads(meta["tokens"])
    except Exception as e:
        raise UserError(f"{path}: not a taps file written by `mlxtoy taps --save` ({e})") from None
    if model is not None:
        ours = model_signature(model)
        if ours != signature:
            diff = ", ".join(f"{k} {signature.get(k)} vs {ours[k]}" for k in ours if ours[k] != signature.get(k))
            raise UserError(f"{path}: taps come from a different architecture ({diff})")
    taps = {}
    for name, v in arrays.items():
        _, layer, site = name.split(".", 2)
        taps[(int(layer), site)] = v
    return taps, signature, tokens


class TapsProbe:
    """Training hook: every `every` steps, tap a fixed probe text and emit a TapsEvent."""

    def __init__(self, tokens: list[int], every: int, heads: bool = True):
        if every <= 0:
            raise UserError(f"taps_every must be > 0, got {every}")
        self.tokens = mx.array([tokens])
        self.every = every
        self.heads = heads

    def __call__(self, model, step: int):
        if step % self.every:
            return None
        stats, heads = summarize(capture(model, self.tokens, heads=self.heads))
        return TapsEvent(step=step, stats=stats, heads=heads)


PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Training a language model, one step at a time."
