"""The shared decoder: per-head attention, RoPE, the pre-norm block and the model, for every
architecture (the specs in `mlxtoy.arch` pick the options; GPT-2 / TinyLM / Gemma 3 subclass).

Mirrors the seed design: per KV head, K = RoPE(W_k[h] x + b_k), V = W_v[h] x + b_v; per Q head
q, kv = q // group_size, scores = K[kv].Q / sqrt(d_head) with a causal (or block-causal) mask,
softmax, head = V.attn; heads concatenated -> W_o; residual; RMSNorm; SwiGLU FFN; residual.

Options every spec reads from `ModelConfig`: QKV bias (qwen2), per-head RMSNorm on q and k
before RoPE (`qk_norm`: qwen3, gemma3), partial rotary (`rope_dims`), sliding-window layers with
their own RoPE base (`sliding_window`, `layer_types`, `rope_local_base`), the attention scale
(`attn_scale`, Gemma's query_pre_attn_scalar). A sliding-window layer masks keys more than
`window - 1` positions back; the KV cache keeps every position, so cached decoding computes
exactly what the uncached forward does.

Heads stay addressable (q/k/v weights are stored per head, shape (heads, d_head, d_model)) but
are computed as one batched head axis: one GEMM per projection, one attention call per layer.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxtoy.model_config import ModelConfig
from mlxtoy.models import fastmath
from mlxtoy.models.cache import KVCache, SlotCache, cache_positions
from mlxtoy.models.attention import attention
from mlxtoy.models.fastmath import Linear, RMSNorm, linear, linear_many, silu, swiglu
from mlxtoy.models.fused_weights import (BLOCK_MATRICES, added_in, added_updates, affine_kept, banked, kernel_matrix,
                                         kept_packs, merged_in, plain_projection, repin_packs)
from mlxtoy.models.prefill import prefill_fits, prefill_route

TAP_SITES = ("attn_norm", "ffn_out", "resid_post")


class HeadProjection(nn.Module):
    """Per-head linear map: weight (n_heads, d_head, d_in), optional bias (n_heads, d_head).

    Returns (B, T, n_heads, d_head). Computed as one GEMM over the flattened head axis.
    """

    def __init__(self, d_in: int, n_heads: int, d_head: int, bias: bool = False):
        super().__init__()
        scale = 1.0 / math.sqrt(d_in)
        self.weight = mx.random.uniform(-scale, scale, (n_heads, d_head, d_in))
        if bias:
            self.bias = mx.zeros((n_heads, d_head))

    @property
    def n_heads(self) -> int:
        return self.weight.shape[0]

    @property
    def d_head(self) -> int:
        return self.weight.shape[1]

    @property
    def d_in(self) -> int:
        return self.weight.shape[2]

    def dense_weight(self) -> mx.array:
        """The (n_heads, d_head, d_in) weight (a quantized projection dequantizes it)."""
        return self.weight

    def flat_weight(self) -> mx.array:
        n_heads, d_head, d_in = self.weight.shape
        return self.weight.reshape(n_heads * d_head, d_in)

    def __call__(self, x: mx.array) -> mx.array:
        return self.heads(linear(x, self.flat_weight()))

    def heads(self, y: mx.array) -> mx.array:
        """x @ flat_weight().T (..., n_heads * d_head) -> bias added, (..., n_heads, d_head)."""
        if "bias" in self:
            y = y + self.bias.reshape(-1)
        return y.reshape(*y.shape[:-1], self.n_heads, self.d_head)


def project_heads(x: mx.array, projections: list[nn.Module]) -> list[mx.array]:
    """Each projection applied to x; plain HeadProjections (no adapter) take one `linear_many`
    call together, which decoding runs as one threaded GEMV."""
    if all(type(p) is HeadProjection for p in projections):
        ys = linear_many(x, [p.weight for p in projections])  # (..., n_heads, d_head) each
        return [y + p.bias if "bias" in p else y for p, y in zip(projections, ys)]
    return [p(x) for p in projections]


def llama3_rope_freqs(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """Per-frequency wavelengths for llama3 RoPE scaling (as in Llama 3.1's reference code).

    Returned in the form `mx.fast.rope(freqs=...)` expects (it divides positions by these).
    """
    factor = scaling.get("factor", 8.0)
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)  # = 1 / inv_freq
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > low_freq_wavelen, freqs * factor, freqs)
    is_medium = (wavelens > high_freq_wavelen) & (wavelens < low_freq_wavelen)
    smooth = (old_context / wavelens - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(is_medium, smooth_freqs, freqs)


class RoPE(nn.Module):
    def __init__(self, cfg: ModelConfig, base: float | None = None, scaled: bool = True):
        super().__init__()
        self.dims = cfg.rope_dims or cfg.d_head
        self.traditional = cfg.rope_traditional
        self.base = base or cfg.rope_base
        self.scale = 1.0
        # Gemma 3's sliding layers keep their own base, unscaled (`scaled=False`)
        scaling = (cfg.rope_scaling or {}) if scaled else {}
        kind = scaling.get("type") or scaling.get("rope_type")
        self._freqs = None
        self._long = None  # LongRoPE: frequencies past `original_max_position_embeddings`
        self.mscale = 1.0
        if kind == "linear":
            self.scale = 1.0 / float(scaling["factor"])
        elif kind == "llama3":
            self._freqs = llama3_rope_freqs(self.dims, self.base, scaling)
        elif kind == "freq_factors":
            # GGUF's rope_freqs tensor: llama.cpp divides each frequency by its factor.
            base_freqs = self.base ** (mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims)
            self._freqs = base_freqs * mx.array(scaling["factors"], dtype=mx.float32)
        elif kind == "longrope":
            # Phi-3: per-frequency factors (short within the original context, long past it),
            # and cos/sin scaled by attention_factor (the rotated dims only)
            base_freqs = self.base ** (mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims)
            self._freqs = base_freqs * mx.array(scaling["short_factor"], dtype=mx.float32)
            self._long = base_freqs * mx.array(scaling["long_factor"], dtype=mx.float32)
            self._original = int(scaling["original_max_position_embeddings"])
            self.mscale = float(scaling["attention_factor"])
        elif kind not in (None, "none", "default"):
            raise ValueError(f"unsupported rope scaling {kind!r}")
        # what mx.fast.rope turns pair i by per position (for the kernel): as it computes them
        half = self.dims // 2
        if self._freqs is not None:
            self._inv_freqs = 1.0 / self._freqs
        else:
            step = np.float32(np.log(np.float32(self.base))) / np.float32(half)
            self._inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(step))
        mx.eval(self._inv_freqs)  # a constant, not ops in every traced graph

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        # x: (B, heads, T, d_head)
        if self._long is not None:
            return self.longrope(x, offset)
        per_row = isinstance(offset, mx.array) and offset.size > 1  # a batch's rows (B,)
        if fastmath.rope_kernel_ok(x) and not per_row:
            return fastmath.rope(x, offset, self._inv_freqs, self.dims, self.traditional, self.scale)
        if self._freqs is not None:
            return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None,
                                scale=self.scale, offset=offset, freqs=self._freqs)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base,
                            scale=self.scale, offset=offset)


    def longrope(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """Short factors while the positions fit the original context, long ones past it (as
        transformers decides per call: by the last position); then the attention factor."""
        def rotate(freqs: mx.array) -> mx.array:
            return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0,
                                offset=offset, freqs=freqs)

        last = offset + x.shape[2]
        if isinstance(last, int):
            y = rotate(self._long if last > self._original else self._freqs)
        else:  # a traced offset (compiled decoding; per row in a batch): both, then select
            y = mx.where((last > self._original).reshape(-1, 1, 1, 1), rotate(self._long), rotate(self._freqs))
        if self.mscale == 1.0:
            return y
        if self.dims == x.shape[-1]:
            return y * self.mscale
        return mx.concatenate([y[..., :self.dims] * self.mscale, y[..., self.dims:]], axis=-1)


class Attention(nn.Module):
    """Per-head q/k/v, optional q/k RMSNorm, RoPE (none with `rope` False or `rope_dims` 0:
    learned positions), causal attention over a sliding window or everything, then W_o."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, bias: bool = False, rope: bool = True):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_head = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        qkv_bias = cfg.qkv_bias or bias
        self.q = HeadProjection(cfg.d_model, cfg.n_heads, cfg.d_head, bias=qkv_bias)
        self.k = HeadProjection(cfg.d_model, cfg.n_kv_heads, cfg.d_head, bias=qkv_bias)
        self.v = HeadProjection(cfg.d_model, cfg.n_kv_heads, cfg.d_head, bias=qkv_bias)
        self.o = Linear(cfg.n_heads * cfg.d_head, cfg.d_model, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.d_head, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.d_head, eps=cfg.norm_eps)
        self.window = cfg.window_of(layer)
        if rope and cfg.rope_dims != 0:
            local = self.window is not None and cfg.rope_local_base is not None
            self.rope = RoPE(cfg, cfg.rope_local_base if local else None, scaled=not local)
        self.scale = cfg.attn_scale or cfg.d_head**-0.5

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None,
                 head_taps: dict | None = None) -> mx.array:
        B, T, _ = x.shape
        q, k, v = project_heads(x, [self.q, self.k, self.v])
        if "q_norm" in self:  # per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(0, 2, 1, 3)  # (B, H, T, Dh)
        k = k.transpose(0, 2, 1, 3)  # (B, KV, T, Dh)
        v = v.transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0  # the first new token's column
        if "rope" in self:
            # its position: per row in a left-padded batch (mlxtoy.engine), where column and
            # position differ by the row's padding
            pos = cache.positions if cache is not None else 0
            pos = pos.reshape(-1) if isinstance(pos, mx.array) else pos
            q = self.rope(q, pos)
            k = self.rope(k, pos)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self.window is not None:
            mask = window_mask(mask, offset, T, k.shape[2], self.window)
        elif mask is None:
            mask = "causal" if T > 1 else None
        if head_taps is not None:
            heads = explicit_attention(q, k, v, self.scale, mask, head_taps)
        else:
            # GQA is native: Q head h reads KV head h // group_size.
            heads = attention(q, k, v, self.scale, mask)
        return self.o(heads.transpose(0, 2, 1, 3).reshape(B, T, -1))


def window_mask(mask: Any, offset: int | mx.array, T: int, S: int, window: int) -> mx.array:
    """Causal and within `window` (key position > query position - window), combined with
    `mask` (None, "causal", boolean or additive). Query positions are offset .. offset+T-1, key
    positions 0 .. S-1 (the cache keeps every position; a traced offset works too)."""
    q_pos = (mx.arange(T) + offset)[:, None]
    k_pos = mx.arange(S)[None, :]
    keep = (k_pos <= q_pos) & (q_pos - k_pos < window)
    if mask is None or isinstance(mask, str):
        return keep
    if mask.dtype == mx.bool_:
        return mask & keep
    return mask + mx.where(keep, 0.0, -mx.inf).astype(mask.dtype)


def explicit_attention(q, k, v, scale, mask, head_taps: dict) -> mx.array:
    """Attention with the weights materialized, for per-head taps (entropy, output norm)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = mx.repeat(k, group, axis=1)
        v = mx.repeat(v, group, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    T, S = scores.shape[-2:]
    if isinstance(mask, str):
        keep = mx.arange(S)[None, :] <= (mx.arange(T)[:, None] + (S - T))
        scores = mx.where(keep, scores, -mx.inf)
    elif mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    probs = mx.softmax(scores.astype(mx.float32), axis=-1)
    logp = mx.log(mx.maximum(probs, 1e-30))
    head_taps["attn_entropy"] = -(probs * logp).sum(-1).mean(axis=(0, 2))  # (H,)
    out = (probs.astype(v.dtype) @ v)
    head_taps["head_out_norm"] = mx.sqrt((out.astype(mx.float32) ** 2).sum(-1)).mean(axis=(0, 2))
    return out


class FeedForward(nn.Module):
    """Gated FFN: down(act(gate x) * up x), act SiLU (SwiGLU) or tanh-GELU (GeGLU)."""

    def __init__(self, cfg: ModelConfig, act: Callable[[mx.array], mx.array] = silu):
        super().__init__()
        self.gate = Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.act = act

    def __call__(self, x: mx.array) -> mx.array:
        if type(self.gate) is Linear and type(self.up) is Linear and "bias" not in self.gate and "bias" not in self.up:
            gate, up = linear_many(x, [self.gate.weight, self.up.weight])  # decoding: one GEMV call
        else:
            gate, up = self.gate(x), self.up(x)
        if self.act is silu:
            return self.down(swiglu(gate, up))
        return self.down(self.act(gate) * up)


class Block(nn.Module):
    """Pre-norm block; with `post_norms` (Gemma) the attention output and the FFN output are
    normed again before their residual adds. Taps: `attn_norm` the normed input to attention,
    `ffn_out` the FFN's contribution just before the residual add, `resid_post` the stream after."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, norm: Callable[[], nn.Module] | None = None,
                 bias: bool = False, ffn: nn.Module | None = None, post_norms: bool = False,
                 rope: bool = True):
        super().__init__()
        norm = norm or (lambda: RMSNorm(cfg.d_model, eps=cfg.norm_eps))
        self.attn_norm = norm()
        self.attn = Attention(cfg, layer, bias, rope)
        self.ffn_norm = norm()
        self.ffn = ffn if ffn is not None else FeedForward(cfg)
        if post_norms:
            self.post_attn_norm = norm()
            self.post_ffn_norm = norm()

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None,
                 taps: dict | None = None) -> mx.array:
        prefill = taps is None and prefill_fits(x, mask, cache) and self.prefill_fused(x)
        if taps is None and (isinstance(cache, SlotCache) or prefill):
            fused = self.decode_fused(x, cache)
            if fused is not None:
                return fused
        return self.forward_ops(x, mask, cache, taps)

    def forward_ops(self, x: mx.array, mask: Any = None, cache: Any = None, taps: dict | None = None) -> mx.array:
        """The block op by op (the fused kernel's reference, and every block it does not fit)."""
        h = self.attn_norm(x)
        head_taps = {} if taps is not None and taps.get("_heads") else None
        a = self.attn(h, mask, cache, head_taps)
        if "post_attn_norm" in self:
            a = self.post_attn_norm(a)
        x = x + a
        ffn_out = self.ffn(self.ffn_norm(x))
        if "post_ffn_norm" in self:
            ffn_out = self.post_ffn_norm(ffn_out)
        x = x + ffn_out
        if taps is not None:
            taps["attn_norm"], taps["ffn_out"], taps["resid_post"] = h, ffn_out, x
            if head_taps:
                taps.update(head_taps)
        return x

    def fused_modules(self) -> list[tuple[nn.Module, nn.Module]] | None:
        """[attn_norm, q, k, v, o, ffn_norm, gate, up, down] for `fastmath.decode_block`, each as
        (the block's module, the plain module it reads), when this is a plain Llama block
        (RMSNorms, per-head q/k/v with RoPE, no q/k norm, window, post-norm, SwiGLU, no biases but
        q/k/v's, all three or none), else None. A projection may carry an adapter (LoRA or DoRA
        around a plain projection, `mlxtoy.models.lora`): the step then reads its merged weight. A
        plain one may be a quantized base's 4- or 8-bit matrix (`affine_kept`), read as it is, a
        LoRA around it (LoRA or DoRA) then added to its product inside the call, as a bank's rows'
        are (`added_in`: a QLoRA run's, a server's adapters)."""
        a, f = self.attn, self.ffn
        if not (type(a) is Attention and type(f) is FeedForward):
            return None
        wrapped = (a.q, a.k, a.v, a.o, f.gate, f.up, f.down)
        q, k, v, o, gate, up, down = plains = [plain_projection(m) for m in wrapped]
        plain = (type(self.attn_norm) is RMSNorm and type(self.ffn_norm) is RMSNorm
                 and self.attn_norm.eps == self.ffn_norm.eps and "post_attn_norm" not in self
                 and "q_norm" not in a and a.window is None
                 and all(type(p) is HeadProjection or isinstance(p, HeadProjection) and affine_kept(p) for p in (q, k, v))
                 and len({"bias" in p for p in (q, k, v)}) == 1  # q, k and v biased alike
                 and "rope" in a and type(a.rope) is RoPE and a.rope._long is None and f.act is silu
                 and all((type(m) is Linear or affine_kept(m)) and "bias" not in m for m in (o, gate, up, down))
                 and not any(merged_in(m, p) and affine_kept(p) for m, p in zip(wrapped, plains)))
        if not plain:
            return None
        norms = [(self.attn_norm, self.attn_norm), (self.ffn_norm, self.ffn_norm)]
        pairs = list(zip(wrapped, plains))
        return [norms[0]] + pairs[:4] + [norms[1]] + pairs[4:]

    def fused_weights(self, modules: list | None = None) -> list[mx.array] | None:
        """The weights of the plain modules of `fused_modules` (or of `modules`, what it gave):
        an adapter's base's, not merged (`decode_packs` merges)."""
        modules = modules or self.fused_modules()
        if modules is None:
            return None
        return [plain.weight for _, plain in modules]

    def decode_packs(self, modules: list | None = None) -> dict[str, mx.array]:
        """This block's matrices in the form its fused step reads, keyed by their index in
        `fused_weights`: an adapter's merged weight, made now; a plain matrix packed where that
        is lossless (the weights of a Q4_0, Q4_1, Q4_K, Q5_0 or Q8_0 GGUF: `fastmath.pack_lossless`), kept while
        the weights are the same (see `kept_packs`)."""
        modules = modules or self.fused_modules()
        if modules is None:
            return kept_packs(self, None, BLOCK_MATRICES)
        adapted = [i for i in BLOCK_MATRICES if merged_in(*modules[i])]
        packs = kept_packs(self, self.fused_weights(modules), [i for i in BLOCK_MATRICES if i not in adapted
                                                               and not affine_kept(modules[i][1])])
        if adapted:
            packs = {**packs, **{str(i): modules[i][0].merged_weight() for i in adapted}}
            mx.eval(packs)
        return packs

    def prefill_fused(self, x: mx.array) -> bool:
        """Whether a short prompt's new tokens `x` go through this block as one fused call rather
        than op by op: measured on this machine (`prefill.prefill_route`) for blocks of this shape
        and these matrices' forms (float32, an adapter's merged float32, packed 4- or 8-bit)."""
        modules = self.fused_modules()
        if modules is None:
            return False
        weights = self.fused_weights(modules)
        biases = [plain.bias for _, plain in modules[1:4] if "bias" in plain]
        if not fastmath.decode_block_ok(x, *weights, *biases):
            return False
        plain = [i for i in BLOCK_MATRICES if not merged_in(*modules[i]) and not affine_kept(modules[i][1])]
        packs = kept_packs(self, weights, plain)  # (what decode_packs keeps; no adapter merged here)

        def form(i: int) -> str:
            p = packs.get(str(i))
            kind = (f"a{modules[i][1].bits}" if affine_kept(modules[i][1]) else "f32" if p is None
                    else fastmath.PACK_FORMS[p.shape[-1] * 32 // weights[i].shape[-1]])
            return kind + ("+lora" if added_in(*modules[i]) else "")

        # the LoRA banks' rows are the batch's; the route is measured on one row of the base
        rows = next((m.rows for m, _ in modules[1:4] if banked(m)), None)

        def one_row(way: Callable[[mx.array, KVCache], mx.array | None]) -> Callable:
            def run(v: mx.array, c: KVCache) -> mx.array | None:
                if rows is None:
                    return way(v, c)
                before, rows.ids = rows.ids, mx.zeros((v.shape[0],), dtype=mx.int32)
                try:
                    return way(v, c)  # (the graph holds the ids it read)
                finally:
                    rows.ids = before
            return run

        a = self.attn
        shape = (x.shape[-1], weights[6].shape[0], a.n_heads, a.n_kv_heads, a.d_head,
                 "/".join(form(i) for i in BLOCK_MATRICES))
        macs = sum(weights[i].size * (32 // modules[i][1].bits if weights[i].dtype == mx.uint32 else 1)
                   for i in BLOCK_MATRICES)
        return prefill_route(x.shape[0] * x.shape[1], shape, macs, one_row(self.decode_fused),
                             one_row(lambda v, c: self.forward_ops(v, "causal", c))) == "fused"

    def decode_fused(self, x: mx.array, cache: SlotCache | KVCache) -> mx.array | None:
        """This block's step for the new tokens of each row as one kernel call (`fastmath.decode_block`):
        a decode step's one token (a SlotCache, its packed matrices with it) or a short prompt's
        (a KVCache, `prefill_fits`; this block's `decode_packs`); None where the block is not
        plain or the kernel does not apply."""
        modules = self.fused_modules()
        if modules is None:
            return None
        weights = self.fused_weights(modules)
        a = self.attn
        biases = [plain.bias for _, plain in modules[1:4] if "bias" in plain]
        prefill = isinstance(cache, KVCache)
        if prefill:
            B, T, _ = x.shape
            blank = mx.zeros((B, a.n_kv_heads, 1, a.d_head))
            cache.reserve(T, like=(blank, blank))
        if not fastmath.decode_block_ok(x, cache.keys, cache.values, *weights, *biases):
            return None
        packs = self.decode_packs(modules) if prefill else cache.packed
        heads = {1: (a.n_heads, a.d_head), 2: (a.n_kv_heads, a.d_head), 3: (a.n_kv_heads, a.d_head)}
        weights = [packs[str(i)] if str(i) in packs else m.merged_weight() if merged_in(m, plain)
                   else kernel_matrix(plain, heads.get(i)) for i, (m, plain) in enumerate(modules)]
        offset = mx.array([cache.offset], dtype=mx.int32) if prefill else cache.offset
        updates, ids = added_updates(modules)
        x, cache.keys, cache.values = fastmath.decode_block(
            x, weights, biases, cache.keys, cache.values, offset, cache.starts, a.rope._inv_freqs, a.rope.dims,
            a.rope.traditional, self.attn_norm.eps, a.scale, a.rope.scale, updates, ids)
        if prefill:
            cache.offset += x.shape[1]
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = [self.make_block(cfg, i) for i in range(cfg.n_layers)]
        self.norm = self.make_norm(cfg)
        if not cfg.tie_embeddings:
            self.output = Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def make_block(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer`'s block: the hook a variant overrides (with `make_norm`, `embed`)."""
        return Block(cfg, layer)

    def embed(self, tokens: mx.array, offset: int | mx.array = 0) -> mx.array:
        # positions enter through RoPE here; models with learned positions use `offset`
        return self.tok_embeddings(tokens)

    def __call__(self, tokens: mx.array, mask: Any = None, cache: list | None = None,
                 taps: dict | None = None) -> mx.array:
        """tokens (B, T) -> logits (B, T, vocab).

        mask: None (causal), or a boolean/additive array broadcastable to (B, H, T, S) such as
        `block_causal_mask(segment_ids)` for packed rows. cache: one KV cache per layer.
        taps: a dict to fill with {(layer, site): array}; None costs nothing.
        """
        return self.logits(self.hidden(tokens, mask, cache, taps))

    def hidden(self, tokens: mx.array, mask: Any = None, cache: list | None = None,
               taps: dict | None = None) -> mx.array:
        x = self.embed(tokens, cache_positions(cache))
        for i, layer in enumerate(self.layers):
            layer_taps = None
            if taps is not None and _wants_layer(taps, i):
                layer_taps = {"_heads": taps.get("_heads", False)}
            x = layer(x, mask, cache[i] if cache is not None else None, layer_taps)
            if layer_taps is not None:
                for site, value in layer_taps.items():
                    if not site.startswith("_"):
                        taps[(i, site)] = value
        return self.norm(x)

    def output_matrix(self) -> mx.array | None:
        """The (vocab, d_model) matrix W with `logits(h)` = h @ W.T (the output layer's, or the
        tied embedding table), where that is all `logits` does; else None."""
        if type(self).logits is not LlamaModel.logits:
            return None
        if "output" in self:
            out = self.output
            return out.weight if type(out) is Linear and "bias" not in out else None
        return self.tok_embeddings.weight if type(self.tok_embeddings) is nn.Embedding else None

    def decode_head_pack(self) -> mx.array | None:
        """`output_matrix()` packed for decoding where that is lossless (as `Block.decode_packs`)."""
        w = self.output_matrix()
        return kept_packs(self, None if w is None else [w], (0,)).get("0")

    def repin_packs(self) -> None:
        """Keep the decode packs for the weights' current array objects, without comparing
        values: tracing a compiled function hands a module new objects for the same weights.
        Only right after such a trace, before anything can have changed the weights."""
        for layer in self.layers:
            if isinstance(layer, Block):
                repin_packs(layer, layer.fused_weights())
        w = self.output_matrix()
        repin_packs(self, None if w is None else [w])

    def logits(self, h: mx.array) -> mx.array:
        if "output" in self:
            return self.output(h)
        if type(self.tok_embeddings) is nn.Embedding:
            return linear(h, self.tok_embeddings.weight)
        return self.tok_embeddings.as_linear(h)


def _wants_layer(taps: dict, i: int) -> bool:
    layers = taps.get("_layers")
    return layers is None or i in layers


def block_causal_mask(segment_ids: mx.array) -> mx.array:
    """Boolean (B, 1, T, T) mask: a token sees earlier tokens of its own segment only.

    segment_ids (B, T): documents packed into one row get distinct ids; padding may use -1
    (padding rows still see themselves so softmax never meets an all-masked row).
    """
    T = segment_ids.shape[1]
    causal = mx.arange(T)[:, None] >= mx.arange(T)[None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None, :, :]
