"""Frozen quantized weights (the QLoRA base): linear layers, per-head projections and the
embedding table kept 4-bit or 8-bit in MLX's affine layout (per group of `group_size` inputs,
w = scale * q + bias), and the one product they all take.

On Metal and CUDA `mx.quantized_matmul` multiplies them as they are. MLX's CPU quantized
matmul runs at a few GFLOP/s, so on CPU the product dequantizes a slab of rows at a time to
float32 for the float32 GEMM: inside one kernel where the CPU kernels are on
(`quant_linear`), else as MLX ops. Its backward dequantizes again for the input
gradient (a frozen base needs no weight gradient), so no float32 copy of a matrix outlives its
own product.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxtoy import backend, settings
from mlxtoy.errors import UserError
from mlxtoy.models.fastmath import GEMV_ROWS, bare, gemm, kernels_module, route_table, single_cotangent
from mlxtoy.models.llama import HeadProjection
from mlxtoy.models.prefill import rows_class

BITS = (4, 8)
GROUP_SIZES = (32, 64)
# Float32 bytes of one dequantized slab on CPU: big enough for the GEMM to run at full rate,
# small enough that a 128k-row output layer never exists whole in float32.
SLAB_BYTES = 64 << 20
# On a GPU, products of at least this many rows take the dequantized slabs too (0: never): an
# experiment against MLX's quantized matmul, which ran QLoRA at a third of LoRA's rate on an H200
GPU_SLAB_ROWS = settings.GPU_SLAB_ROWS.value()


# ---- the kernels' quantized products (x @ W.T and its input gradient for an affine-quantized W) ----

def dequantize_affine(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
                      ) -> mx.array | None:
    """mx.dequantize's float32 values for a 2-D affine-quantized matrix, by the kernels (threaded:
    MLX's CPU dequantize runs on one thread); None where the kernels are off."""
    if kernels_module() is None or w.ndim != 2:
        return None
    return kernels_module().dequantize_affine(w, scales, biases, group_size, bits)


def quant_linear_ok(x: mx.array) -> bool:
    """Whether `quant_linear` takes x (the kernels are on, float32)."""
    return kernels_module() is not None and x.dtype == mx.float32


@functools.lru_cache(maxsize=None)
def _kernel_quant_linear(group_size: int, bits: int, symmetric: bool):
    @mx.custom_function
    def product(x, w, scales, biases):
        rows = x.reshape(-1, x.shape[-1])
        return kernels_module().quant_linear(rows, w, scales, biases, group_size, bits, symmetric=symmetric
                               ).reshape(*x.shape[:-1], w.shape[0])

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, w, scales, biases = primals
        g = single_cotangent(cotangent).reshape(-1, cotangent.shape[-1])
        dx = quant_linear_input_grad(g, w, scales, biases, group_size, bits).reshape(x.shape)
        return dx, mx.zeros_like(w), mx.zeros_like(scales), mx.zeros_like(biases)

    return product


def quant_linear(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                 symmetric: bool = False) -> mx.array:
    """x @ W.T for an affine-quantized W by the kernels (a slab of W dequantized at a time into
    the BLAS's SGEMM, forward and input gradient; at most 4 rows of x, decoding, the fused
    quantized GEMV that reads the packed words as they are, and not the biases where they are
    -2^(bits - 1) scales: `symmetric`); see `quant_linear_ok`. Inside `inference()` the kernel is
    called bare (no gradient node), and a prompt's or a batch's rows take the GEMV (its VNNI or
    AVX2 integer form, x rounded to 16 bits a group as in decoding; else its float32 form, four
    rows a pass, each row the bits it gets alone) where that measured faster than the slabs here
    for their rows class (`prompt_takes_gemv`)."""
    if bare(x):
        rows = x.reshape(-1, x.shape[-1])
        gemv = prompt_takes_gemv(rows.shape[0], w, scales, biases, group_size, bits, symmetric)
        return kernels_module().quant_linear(rows, w, scales, biases, group_size, bits, symmetric=symmetric,
                                             inference=gemv).reshape(*x.shape[:-1], w.shape[0])
    return _kernel_quant_linear(group_size, bits, symmetric)(x, w, scales, biases)


PROMPT_ROUTED_MACS = 1 << 22  # smaller products take the GEMV unmeasured (measuring would cost more)
# The GEMV's values against the slabs': x rounded to 16 bits a group (each input within 1 / 65278
# of its group's largest) moved products of random rows by up to 6e-5 of the largest output (128
# rows, 8192 inputs), against ~1e-6 for sums in another order; a wrong product is off by far more
PROMPT_PARITY_RTOL = 1e-3


def prompt_takes_gemv(rows: int, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                      symmetric: bool) -> bool:
    """Whether `rows` rows of x (no gradient) take the GEMV rather than the slabs and the SGEMM:
    up to decoding's 4 rows always; more (a prompt, a batch of decoded rows against an 8-bit
    head), up to `quant_gemv_max_rows` for this W, if that measured faster here for the rows
    class and matrix shape (`mlxtoy.routes`; the slabs, exact, are the reference)."""
    if rows <= GEMV_ROWS:
        return True
    K = kernels_module()
    d_in = scales.shape[-1] * group_size
    most = K.quant_gemv_max_rows(d_in, group_size, bits)
    if rows > most:
        return False
    cls = min(rows_class(rows), most)  # measured at the next power of two, as a prefill's block is
    if cls * w.shape[0] * d_in < PROMPT_ROUTED_MACS:
        return True
    shape = (cls, w.shape[0], d_in, bits, group_size, "sym" if symmetric else "affine")
    table = route_table()
    route = table.kept_route("quant-prompt", shape, ["slabs", "gemv"])
    if route is None:
        x = mx.array(np.random.default_rng(0).standard_normal((cls, d_in), dtype=np.float32))
        mx.eval(x)

        def product(gemv: bool):
            def run():
                y = K.quant_linear(x, w, scales, biases, group_size, bits, symmetric=symmetric, inference=gemv)
                mx.eval(y)
                return [np.array(y)]
            return run

        with mx.stream(mx.cpu):
            route = table.choose("quant-prompt", shape, {"slabs": product(False), "gemv": product(True)},
                                 2.0 * cls * w.shape[0] * d_in,
                                 f"{bits}-bit product of {cls} rows x {d_in} x {w.shape[0]}", PROMPT_PARITY_RTOL)
    return route == "gemv"


def quant_linear_input_grad(g: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                            bits: int) -> mx.array:
    """g (N, rows) @ W for an affine-quantized W (rows, d_in) by the kernels, with no gradient of its
    own (`quant_linear`'s input gradient, and the fused loss's through a quantized output layer)."""
    return kernels_module().quant_linear(g, w, scales, biases, group_size, bits, True)


def _gpu_slabs(rows: int) -> bool:
    return 0 < GPU_SLAB_ROWS <= rows


QUANT_LEAVES = ("weight", "scales", "biases")


def dequantize(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
               dtype: mx.Dtype = mx.float32) -> mx.array:
    """The dense (rows, d_in) matrix in `dtype`. scale * q + bias is formed in float32 (GGML's own
    values for Q4_0 / Q4_1 / Q8_0 blocks, exactly) and then rounded once: in bfloat16 the sum
    would cancel (a Q8_0 block's bias is -128 scales) and lose up to half a quantization step.
    The CPU kernels, where they are on, compute the same values on every core."""
    dense = dequantize_affine(w, scales, biases, group_size, bits)
    if dense is None:
        dense = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
    return dense if dtype == mx.float32 else dense.astype(dtype)


def slabs(rows: int, d_in: int) -> list[tuple[int, int]]:
    """Row ranges of at most SLAB_BYTES of float32 each."""
    step = max(1, min(rows, SLAB_BYTES // (4 * d_in)))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def dense_slab(w: mx.array, scales: mx.array, biases: mx.array, a: int, b: int, group_size: int, bits: int,
               dtype: mx.Dtype, after: list[mx.array]) -> mx.array:
    """Rows a:b of the quantized W dequantized to `dtype`, only once `after` exists (the input,
    the previous slab's result): MLX would otherwise schedule every slab of every layer up
    front, as they depend on nothing computed, and hold them all."""
    return dequantize(mx.depends(w[a:b], after), scales[a:b], biases[a:b], group_size, bits, dtype)


@functools.lru_cache(maxsize=None)
def slab_product(group_size: int, bits: int):
    """x @ W.T for a quantized W, slab by slab, with the input gradient as its only gradient."""

    # the products inside need no gradient of their own: `fastmath.gemm` (no gradient node)
    @mx.custom_function
    def product(x, w, scales, biases):
        rows = x.reshape(-1, x.shape[-1])
        parts: list[mx.array] = []
        for a, b in slabs(w.shape[0], x.shape[-1]):
            dense = dense_slab(w, scales, biases, a, b, group_size, bits, x.dtype, parts[-1:] or [rows])
            parts.append(gemm(rows, dense, trans_b=True))
        y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, w, scales, biases = primals
        dx = slab_input_grad(cotangent.reshape(-1, cotangent.shape[-1]), w, scales, biases, group_size, bits)
        return (dx.reshape(x.shape).astype(x.dtype), mx.zeros_like(w), mx.zeros_like(scales),
                mx.zeros_like(biases))

    return product


def slab_input_grad(g: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                    bits: int) -> mx.array:
    """g (N, rows) @ W for a quantized W, slab by slab (MLX ops), each slab dequantized only once
    the previous slab's part exists."""
    dx = None
    for a, b in slabs(w.shape[0], w.shape[1] * 32 // bits):
        part = gemm(g[:, a:b], dense_slab(w, scales, biases, a, b, group_size, bits, g.dtype,
                                          [g] if dx is None else [dx]))
        dx = part if dx is None else dx + part
    return dx


def quantized_input_grad(g: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                         group_size: int, bits: int) -> mx.array:
    """g (N, rows) @ W for the quantized W (rows, d_in), with no gradient of its own: the input
    gradient of `quantized_linear`, for a loss that computes it itself (the fused output loss)."""
    if not backend.INFO.native_quantized_matmul:
        if quant_linear_ok(g):
            return quant_linear_input_grad(g, w, scales, biases, group_size, bits)
        return slab_input_grad(g, w, scales, biases, group_size, bits)
    if _gpu_slabs(g.shape[0]):
        return slab_input_grad(g, w, scales, biases, group_size, bits)
    if scales.dtype != g.dtype:
        scales, biases = scales.astype(g.dtype), biases.astype(g.dtype)
    return mx.quantized_matmul(g, w, scales, biases, transpose=False, group_size=group_size, bits=bits)


def quantized_linear(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                     group_size: int, bits: int, symmetric: bool = False) -> mx.array:
    """x @ W.T for the quantized W (rows, d_in): dequantized slabs and the float32 GEMM on CPU,
    `mx.quantized_matmul` elsewhere. `symmetric`: the biases are -2^(bits - 1) scales (Q4_0 /
    Q8_0 blocks), so the kernels' decoding GEMV need not read them."""
    if not backend.INFO.native_quantized_matmul:
        if quant_linear_ok(x):
            return quant_linear(x, w, scales, biases, group_size, bits, symmetric)
        return slab_product(group_size, bits)(x, w, scales, biases)
    if _gpu_slabs(x.size // x.shape[-1]):
        return slab_product(group_size, bits)(x, w, scales, biases)
    if scales.dtype != x.dtype:
        scales, biases = scales.astype(x.dtype), biases.astype(x.dtype)
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


@dataclass
class PackedMatrix:
    """A (rows, d_in) matrix in MLX's affine quantized layout, as the loader hands it over."""
    weight: mx.array  # uint32 (rows, d_in * bits / 32)
    scales: mx.array  # (rows, d_in / group_size)
    biases: mx.array
    group_size: int
    bits: int
    symmetric: bool = False  # biases = -2^(bits - 1) scales: a Q4_0 / Q8_0 block's

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1] * 32 // self.bits

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes

    def dense(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        return dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits, dtype)

    def rows(self, a: int, b: int) -> "PackedMatrix":
        return PackedMatrix(self.weight[a:b], self.scales[a:b], self.biases[a:b], self.group_size, self.bits,
                            self.symmetric)


# The embedding table and the output layer stay quantized where the file holds them in MLX's
# layout already (exact); quantizing them at load costs accuracy on every token, so only on
# request (`QuantPlan.tables`).
TABLES = ("tok_embeddings.weight", "output.weight")


@dataclass(frozen=True)
class QuantPlan:
    """Which matrices a loader keeps quantized, and how it quantizes those a file does not hold
    in MLX's layout already (Q4_0 / Q4_1 / Q8_0 blocks keep their own 4 or 8 bits, group 32).
    `tables`: the embedding table and the output layer are quantized at load as well."""
    bits: int = 4
    group_size: int = 32
    tables: bool = False

    @classmethod
    def of(cls, cfg) -> "QuantPlan":
        """The plan a TrainConfig's qlora_bits / qlora_group_size / qlora_tables ask for, checked."""
        return cls(cfg.qlora_bits, cfg.qlora_group_size, cfg.qlora_tables).validate()

    def matrices(self, spec, cfg) -> set[str]:
        """Our parameter names to quantize: every LoRA-targetable projection of every block."""
        return {f"layers.{i}.{path}.weight" for i in range(cfg.n_layers) for path in spec.lora_targets.values()}

    def validate(self) -> "QuantPlan":
        if self.bits not in BITS:
            raise UserError(f"qlora_bits: {self.bits} (choose 4 or 8)")
        if self.group_size not in GROUP_SIZES:
            raise UserError(f"qlora_group_size: {self.group_size} (choose 32 or 64)")
        return self

    def layout(self, param: str, shape: tuple[int, ...], targets: set[str], exact_bits: int | None = None
               ) -> tuple[int, int] | None:
        """(bits, group size) `param` is kept in, or None for a dense one. `targets`: this
        model's projections (`matrices`); `exact_bits`: the file holds it in MLX's layout
        already, with these bits and group 32 (a GGUF's Q4_0 / Q4_1 / Q8_0 blocks), which it
        keeps; the tables are kept so, or quantized with `tables`."""
        table = param in TABLES and bool(exact_bits or self.tables)
        if len(shape) not in (2, 3) or shape[-1] % 32 or not (param in targets or table):
            return None
        if exact_bits:
            return exact_bits, 32
        return (self.bits, self.group_size) if shape[-1] % self.group_size == 0 else None



def quantize_dense(w: mx.array, plan: QuantPlan) -> tuple[PackedMatrix, float]:
    """A float matrix (rows, d_in) -> (PackedMatrix, its relative RMS error), in float32."""
    w = w.astype(mx.float32)
    q, scales, biases = mx.quantize(w, plan.group_size, plan.bits)
    packed = PackedMatrix(q, scales.astype(mx.float16), biases.astype(mx.float16), plan.group_size, plan.bits)
    err = mx.sqrt(mx.sum(mx.square(packed.dense() - w)) / mx.maximum(mx.sum(mx.square(w)), 1e-30))
    return packed, float(err.item())


class QuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product is `quantized_linear` (fast on CPU as well)."""

    @classmethod
    def of(cls, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
           bias: mx.array | None = None, symmetric: bool = False) -> "QuantizedLinear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.group_size, layer.bits, layer.mode, layer.symmetric = group_size, bits, "affine", symmetric
        layer.weight, layer.scales, layer.biases = w, scales, biases
        if bias is not None:
            layer.bias = bias
        layer.freeze()
        return layer

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_linear(x, self.weight, self.scales, self.biases, self.group_size, self.bits, self.symmetric)
        return y + self.bias if "bias" in self else y


class QuantizedHeadProjection(HeadProjection):
    """A per-head projection (n_heads, d_head, d_in) kept quantized as its flat
    (n_heads * d_head, d_in) matrix; heads stay addressable through `dense_weight()`."""

    def __init__(self, w: mx.array, scales: mx.array, biases: mx.array, n_heads: int, d_head: int,
                 group_size: int, bits: int, bias: mx.array | None = None, symmetric: bool = False):
        nn.Module.__init__(self)
        self.weight, self.scales, self.biases = w, scales, biases
        self.shape_heads = (n_heads, d_head)
        self.group_size, self.bits, self.symmetric = group_size, bits, symmetric
        if bias is not None:
            self.bias = bias
        self.freeze()

    @property
    def n_heads(self) -> int:
        return self.shape_heads[0]

    @property
    def d_head(self) -> int:
        return self.shape_heads[1]

    @property
    def d_in(self) -> int:
        return self.weight.shape[1] * 32 // self.bits

    def flat_weight(self) -> mx.array:
        return dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits)

    def dense_weight(self) -> mx.array:
        return self.flat_weight().reshape(self.n_heads, self.d_head, self.d_in)

    def unfreeze(self, *args, **kwargs):
        super().unfreeze(*args, **kwargs)
        self.freeze(keys=list(QUANT_LEAVES), recurse=False)  # the base stays frozen

    def __call__(self, x: mx.array) -> mx.array:
        return self.heads(quantized_linear(x, self.weight, self.scales, self.biases, self.group_size, self.bits,
                                           self.symmetric))


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose use as the output layer is `quantized_linear`."""

    @classmethod
    def of(cls, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
           dtype: mx.Dtype = mx.float32, symmetric: bool = False) -> "QuantizedEmbedding":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.group_size, layer.bits, layer.mode, layer.symmetric = group_size, bits, "affine", symmetric
        layer.num_embeddings, layer.dims = w.shape[0], w.shape[1] * 32 // bits
        layer.weight, layer.scales, layer.biases = w, scales, biases
        layer.out_dtype = dtype  # of the rows it gives: the model's compute dtype
        layer.freeze()
        return layer

    def __call__(self, x: mx.array) -> mx.array:
        return dequantize(self.weight[x], self.scales[x], self.biases[x], self.group_size, self.bits, self.out_dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_linear(x, self.weight, self.scales, self.biases, self.group_size, self.bits,
                                self.symmetric)


QUANTIZED_TYPES = (QuantizedLinear, QuantizedHeadProjection, QuantizedEmbedding)


def _child(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, name = path.rpartition(".")
    parent = model
    for part in parent_path.split(".") if parent_path else []:
        parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
    return parent, name


def quantized_module(dense: nn.Module, packed: PackedMatrix, bias: mx.array | None = None,
                     dtype: mx.Dtype = mx.float32) -> nn.Module:
    """The quantized stand-in for `dense` (a Linear, HeadProjection or Embedding of the model
    being built) holding `packed`; an embedding gives rows in `dtype`, which every product's
    input then has. On a GPU a projection holds its scales and biases in `dtype` too:
    `mx.quantized_matmul` takes them in its input's dtype, so a GGUF's float16 ones would be cast
    in every product (`quantized_linear`), two more passes over them each time. The CPU, and an
    embedding's lookup, keep them as stored."""
    w, scales, biases, group_size, bits, sym = (packed.weight, packed.scales, packed.biases,
                                                packed.group_size, packed.bits, packed.symmetric)
    if isinstance(dense, nn.Embedding):
        return QuantizedEmbedding.of(w, scales, biases, group_size, bits, dtype, sym)
    if backend.INFO.native_quantized_matmul and scales.dtype != dtype:
        scales, biases = scales.astype(dtype), biases.astype(dtype)
    if isinstance(dense, HeadProjection):
        return QuantizedHeadProjection(w, scales, biases, dense.n_heads, dense.d_head, group_size, bits, bias, sym)
    if isinstance(dense, nn.Linear):
        return QuantizedLinear.of(w, scales, biases, group_size, bits, bias, sym)
    raise TypeError(f"cannot quantize a {type(dense).__name__}")


def install_quantized(model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Swap in quantized modules wherever `weights` holds a PackedMatrix (`<path>.weight`),
    taking it (and the module's bias) out of `weights`; -> the dense rest, for `model.update`.
    A quantized embedding gives rows in the dense weights' dtype (the compute dtype)."""
    rest = dict(weights)
    dtype = next((v.dtype for v in weights.values() if isinstance(v, mx.array)
                  and mx.issubdtype(v.dtype, mx.floating)), mx.float32)
    for key in [k for k, v in weights.items() if isinstance(v, PackedMatrix)]:
        path = key[: -len(".weight")]
        parent, name = _child(model, path)
        dense = parent[int(name)] if name.isdigit() else getattr(parent, name)
        setattr(parent, name, quantized_module(dense, rest.pop(key), rest.pop(path + ".bias", None), dtype))
    return rest


def quantization_report(errors: dict[str, float]) -> str:
    """One line on the error that quantizing at load added: the worst tensor's relative RMS."""
    if not errors:
        return ""
    name, worst = max(errors.items(), key=lambda kv: kv[1])
    mean = sum(errors.values()) / len(errors)
    return (f"quantized {len(errors)} tensors at load: relative RMS error mean {mean:.4f}, "
            f"worst {worst:.4f} ({name})")


def parameter_count(model: nn.Module) -> int:
    """The model's parameters as weights, not storage: a quantized matrix counts rows x d_in
    (not its packed words, scales and biases)."""
    total = 0
    for _, m in model.named_modules():
        own = {k: v for k, v in m.items() if isinstance(v, mx.array) and not k.startswith("_")}
        if isinstance(m, QUANTIZED_TYPES):
            total += m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits
            own = {k: v for k, v in own.items() if k not in QUANT_LEAVES}
        total += sum(v.size for v in own.values())
    return total


def describe_quantized(model: nn.Module) -> dict[str, Any]:
    """{bits/group: count} of the quantized modules, for the log and config.yaml."""
    counts: dict[str, int] = {}
    for _, m in model.named_modules():
        if isinstance(m, QUANTIZED_TYPES):
            key = f"{m.bits}-bit/g{m.group_size}"
            counts[key] = counts.get(key, 0) + 1
    return counts
