"""This machine's routes measured for a model's shapes up front (`mlxtoy doctor --calibrate`),
instead of when a training step or a prompt first meets each shape (`fastmath.gemm_route`,
`attention.attention_route`, `prefill.prefill_route`), and the table of what was measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import gguf
import mlx.core as mx
import numpy as np

from mlxtoy import cpublas, fsutil, settings
from mlxtoy.model_config import ModelConfig
from mlxtoy.models import fastmath, prefill
from mlxtoy.models.attention import attention_route
from mlxtoy.models.fastmath import gemm_on, gemm_route, kernels_module, route_table
from mlxtoy.models.fused_weights import BLOCK_MATRICES
from mlxtoy.models.llama import Block
from mlxtoy.models.lora import TARGET_PATHS
from mlxtoy.models.quant import PackedMatrix, install_quantized


@dataclass(frozen=True)
class BlockShapes:
    """The dimensions that decide a transformer block's products and attention."""

    name: str
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    vocab: int

    @staticmethod
    def of(cfg: ModelConfig, name: str = "model") -> "BlockShapes":
        return BlockShapes(name, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.vocab_size)

    def matrices(self) -> list[tuple[int, int]]:
        """(outputs, inputs) of q, k/v, o, gate/up and down."""
        d, q, kv = self.d_model, self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        return [(q, d), (kv, d), (d, q), (self.d_ff, d), (d, self.d_ff)]


# what `doctor --calibrate` measures: the built-in model's shapes and a 1B model's
REFERENCE_SHAPES = (BlockShapes("SmolLM2-135M", 576, 1536, 9, 3, 64, 49152),
                    BlockShapes("Llama-3.2-1B", 2048, 8192, 32, 8, 64, 128256))


def step_products(matrices: list[tuple[int, int]], rows: int, training: bool) -> list[tuple[str, int, int, int]]:
    """(form, M, N, K) of op(a) (M, K) @ op(b) (K, N) of a step of `rows` rows through these
    (outputs, inputs) matrices: each one's forward x W^T (nt), with `training` its input's
    gradient dY W (nn) and its weight's dY^T X (tn) too."""
    products = []
    for n_out, k_in in matrices:
        products.append(("nt", rows, n_out, k_in))
        if training:
            products += [("nn", rows, k_in, n_out), ("tn", n_out, k_in, rows)]
    return products


def calibrate(shapes: BlockShapes, batch: int, seq_len: int, training: bool) -> None:
    """Measure (where not yet measured, or due a second look: `RouteTable.due`) the routes of a
    step of `batch` rows of `seq_len` tokens through blocks of these shapes: each product's
    forward, with `training` its input's and its weight's gradients too (the weight's: dY^T X,
    where the forward takes the kernels' GEMM), and the attention. (The loss's products:
    `logprobs.calibrate_loss`.)"""
    if gemm_on():
        for form, M, N, K in step_products(shapes.matrices(), batch * seq_len, training):
            gemm_route(form, M, N, K)
    attention_route(batch, shapes.n_heads, shapes.n_kv_heads, seq_len, seq_len, shapes.d_head, training)


# the matrices' forms a prompt's prefill route is measured for: float32 (a Hugging Face folder,
# a trained run), the 4-bit grid of a Q4_1 / Q4_0 GGUF (the built-in model), which the fused
# block reads packed, and a Q4_0 GGUF's blocks kept 4-bit (`--quantized`, a 1B-class model's
# default), which it reads as they are where the kernels can (`fastmath.affine_decode_ok`; their
# products' prompt routes are measured on the way, `quant.prompt_takes_gemv`)
PREFILL_FORMS = ("f32", "q4", "a4")


def reference_block(shapes: BlockShapes, form: str, seed: int = 0) -> Block:
    """A Llama block of these shapes with random weights, its matrices float32 ("f32"), on the
    grid a Q4_1 GGUF loads as ("q4", by gguf-py's own quantizer), or Q4_0 blocks kept as a
    quantized base keeps them ("a4", needs the kernels), as a model's blocks are."""
    if form not in PREFILL_FORMS:
        raise ValueError(f"unknown form {form!r} (one of {PREFILL_FORMS})")
    cfg = ModelConfig(arch="llama", vocab_size=16, d_model=shapes.d_model, n_layers=1, n_heads=shapes.n_heads,
                      n_kv_heads=shapes.n_kv_heads, d_head=shapes.d_head, d_ff=shapes.d_ff)
    mx.random.seed(seed)
    block = Block(cfg)
    qtype = gguf.GGMLQuantizationType.Q4_1 if form == "q4" else gguf.GGMLQuantizationType.Q4_0
    paths = dict(zip(BLOCK_MATRICES, TARGET_PATHS.values()))  # q, k, v, o, gate, up, down, in fused order
    packed = {}
    for i, (_, plain) in (enumerate(block.fused_modules()) if form != "f32" else []):
        if i in BLOCK_MATRICES:
            flat = np.array(plain.weight).reshape(-1, plain.weight.shape[-1])
            blocks = gguf.quants.quantize(flat, qtype)
            if form == "q4":
                plain.weight = mx.array(gguf.quants.dequantize(blocks, qtype).reshape(plain.weight.shape))
            else:  # the loader's conversion of a Q4_0 tensor (`gguf_file.affine_blocks`)
                words, scales, biases, bits = kernels_module().affine_blocks(
                    np.ascontiguousarray(blocks).reshape(-1), int(qtype), flat.shape[0], flat.shape[1])
                packed[paths[i] + ".weight"] = PackedMatrix(words, scales, biases, 32, bits, symmetric=True)
    install_quantized(block, packed)
    mx.eval(block.parameters())
    return block


def calibrate_prefill(shapes: BlockShapes, forms: tuple[str, ...] = PREFILL_FORMS) -> None:
    """Measure (where not yet measured, or due a second look: `RouteTable.due`) whether a
    prompt's new tokens go through blocks of these shapes as the fused kernel's one call or op
    by op, for every rows class that is measured (`prefill.prefill_route`), with the matrices in
    each of `forms` (the 4-bit blocks kept as they are only where the fused block reads them
    here)."""
    readable = fastmath.affine_decode_ok(shapes.d_model) and fastmath.affine_decode_ok(shapes.d_ff)
    forms = tuple(f for f in forms if f != "a4" or readable)
    top = prefill.PREFILL_FUSED_ROWS
    classes = sorted({prefill.rows_class(n) for n in range(prefill.PREFILL_UNMEASURED_ROWS + 1, top + 1)})
    for form in forms:
        block = reference_block(shapes, form)
        with fastmath.inference():
            for rows in classes:
                block.prefill_fused(mx.zeros((1, rows, shapes.d_model)))


# The BLAS is timed on a training step's products of each reference model (`blas_products`): its
# forward (nt), input gradient (nn) and weight gradient (tn) of q, gate/up and down. A probe of
# one shape chose OpenBLAS on an Intel Xeon (Emerald Rapids) where MKL trained SmolLM2 1.13x
# faster: the libraries' lead changes with the shape and the form.
BLAS_ROWS = {"SmolLM2-135M": 1024, "Llama-3.2-1B": 256}  # rows a product of a step: batch x tokens
# processes per BLAS, taken in turn with the others' (each product: its best time); with 2 one
# doctor run of seven on the Emerald Rapids, in a slow phase of the VM, rated OpenBLAS ahead
BLAS_LOOKS = 3


def blas_products(shapes: BlockShapes, rows: int) -> list[tuple[str, int, int, int]]:
    """A training step's products through q, gate/up and down of these blocks (`step_products`)."""
    matrices = shapes.matrices()
    return step_products([matrices[i] for i in (0, 3, 4)], rows, training=True)


def blas_workload() -> dict[str, list[tuple[str, int, int, int]]]:
    return {s.name: blas_products(s, BLAS_ROWS[s.name]) for s in REFERENCE_SHAPES}


# run in a process of its own per BLAS (a library loaded for MLX cannot be unloaded); prints each
# product's best time, by model in the workload's order, after a warm-up on the first product (a
# fresh process's first products run slow)
_BLAS_PROBE = """
import json, sys, time
import mlxtoy
import mlx.core as mx
from mlxtoy import backend

work = json.loads(sys.argv[1])
# the operands are views of one random vector: drawing each anew took most of the probe's time
pool = mx.random.uniform(-1, 1, (max(max(m * k, k * n) for ps in work.values() for _, m, n, k in ps),))
mx.eval(pool)

def run(form, m, n, k):
    a = pool[:m * k].reshape((k, m) if form == "tn" else (m, k))
    b = pool[:k * n].reshape((n, k) if form == "nt" else (k, n))
    a = a.T if form == "tn" else a
    b = b.T if form == "nt" else b
    return lambda: mx.eval(a @ b)

warm = run(*next(iter(work.values()))[0])
start = time.perf_counter()
while time.perf_counter() - start < 0.1:
    warm()

def best_time(product):
    product()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - start)
    return best

seconds = {name: [best_time(run(*p)) for p in products] for name, products in work.items()}
print(json.dumps({"blas": backend.INFO.blas, "seconds": seconds}))
"""


def blas_rate(work: dict[str, list[tuple[str, int, int, int]]], seconds: dict[str, list[float]]) -> float:
    """GFLOP/s of a BLAS over the workload, given each product's best time (by model, in the
    workload's order): each model's products' flops over their summed times, and the geometric
    mean over the models (a small model's step counts as much as a large one's, whose products
    would otherwise outweigh it)."""
    rates = []
    for name, products in work.items():
        flops = sum(2.0 * m * n * k for _, m, n, k in products)
        rates.append(flops / sum(seconds[name]) / 1e9)
    return float(np.exp(np.mean(np.log(rates))))


def calibrate_blas() -> dict[str, float | None]:
    """Time MLX's float32 products under each optimized BLAS found here (MKL, OpenBLAS), each in
    processes of its own taken in turn, and keep the fastest for the next processes
    (`cpublas.measured_blas`); -> GFLOP/s by BLAS (`blas_rate`; None where it would not load).
    A library measured here before is rated by its better calibration (as the route table's
    second look: other work on the machine only ever slows a look)."""
    libraries = cpublas.blas_paths()
    work = blas_workload()
    best: dict[str, dict[str, list[float]] | None] = {}
    for _ in range(BLAS_LOOKS):
        for kind in libraries:
            env = dict(os.environ, **{settings.BLAS.name: kind, settings.KERNELS.name: "0"})
            r = subprocess.run([sys.executable, "-c", _BLAS_PROBE, json.dumps(work)], env=env,
                               capture_output=True, text=True, timeout=300)
            try:
                out = json.loads(r.stdout.strip().splitlines()[-1])
                seconds = {name: [float(s) for s in out["seconds"][name]] for name in work} if out["blas"] == kind else None
            except (ValueError, IndexError, KeyError, TypeError):
                seconds = None
            if seconds is None or (kind in best and best[kind] is None):
                best[kind] = None  # a look that failed: the library is not rated
            else:
                earlier = best.get(kind, seconds)
                best[kind] = {name: list(map(min, times, earlier[name])) for name, times in seconds.items()}
    kept = cpublas.kept_blas(libraries).get("gflops", {})
    rates = {kind: (None if seconds is None else max(blas_rate(work, seconds), float(kept.get(kind, 0.0))))
             for kind, seconds in best.items()}
    timed = {kind: rate for kind, rate in rates.items() if rate is not None}
    if len(timed) > 1:
        data = {"fingerprint": cpublas.blas_fingerprint(libraries), "fastest": max(timed, key=timed.get),
                "gflops": {kind: round(rate, 1) for kind, rate in timed.items()}}
        fsutil.write_text_atomic(str(settings.cache_dir() / cpublas.BLAS_FILE), json.dumps(data, indent=1) + "\n")
    return rates


def measured() -> list[dict]:
    """Every route measured on this machine (the cache), as rows for `doctor`."""
    table = route_table()
    return [{"work": key, "route": choice.route,
             "gflops": {name: (None if rate is None else round(rate, 1)) for name, rate in choice.gflops.items()},
             "seconds": round(choice.seconds, 3)}
            for key, choice in sorted(table.choices.items())]
