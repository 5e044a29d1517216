"""Where a SmolLM2 LoRA training step spends its time (batch 4 x 256, float32 on CPU, the BLAS threads
it is given): the whole compiled step, then its parts timed alone (min of 5 runs; the parts
overlap and do not add up exactly). Run it on every core and under `taskset` on a few: the parts
whose time does not fall with the cores are what bounds a many-core machine.

    python bench/profile_step.py [--model smollm2-135m]   # a GGUF, a Hugging Face folder or a
                                                          # built-in name of SmolLM2-135M's shapes
"""
from __future__ import annotations

import argparse
import time

import mlxtoy  # noqa: F401  (fast BLAS first)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlxtoy.config import TrainConfig
from mlxtoy.loading import load
from mlxtoy.models.lora import apply_lora
from mlxtoy.models.attention import attention
from mlxtoy.models.fastmath import linear, rms_norm, swiglu
from mlxtoy.train.logprobs import OutputWeights, output_cross_entropy
from mlxtoy.train.objectives import sft_loss
from mlxtoy.train.step import Stepper, make_optimizer
from mlxtoy.train.data import Batch
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--model", default="smollm2-135m")
args = ap.parse_args()
B, T = 4, 256
model, _ = load(args.model, dtype=mx.float32)
base_ws = [v.reshape(-1, v.shape[-1]) for k, v in tree_flatten(model.parameters()) if v.ndim >= 2 and k.startswith("layers.")]
apply_lora(model, ["q", "v"], 8, 16.0); mx.eval(model.parameters())
cfg = TrainConfig(model="x", method="lora", steps=100, batch_size=B, seq_len=T, lr=1e-4, schedule="constant", grad_clip=0)
opt = make_optimizer(cfg); opt.init(model.trainable_parameters())
st = Stepper(model, opt, cfg, packed=False)
rng = np.random.default_rng(0)
x = rng.integers(0, 49152, (B, T + 1)).astype(np.int32)
b = Batch(x[:, :-1], x[:, 1:], np.ones((B, T), np.float32), np.zeros((B, T), np.int32), B * T, B * T)
inp, tgt, w = mx.array(b.inputs), mx.array(b.targets), mx.array(b.weights); norm = mx.array(float(B * T))
def bench(name, f, n=5, scale=1):
    f(); f(); ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    print(f"{name:52s} {min(ts) * scale:6.2f} s", flush=True)
bench("whole step (Stepper: fwd, bwd, AdamW, guard)", lambda: mx.eval(st([b]), st.state))
lg = nn.value_and_grad(model, lambda m, *a: sft_loss(m, *a))
vg = mx.compile(lambda *a: lg(model, *a))
bench("loss + gradients (no optimizer)", lambda: mx.eval(vg(inp, tgt, w, None, norm)))
fh = mx.compile(lambda x: model.hidden(x))
bench("forward through the 30 blocks", lambda: mx.eval(fh(inp)))
h = mx.random.normal((B * T, 576)); t1 = tgt.reshape(-1); c = mx.random.uniform(shape=(B * T,))
mx.eval(h, c)  # inputs a compiled function captures unevaluated would be recomputed in every call
hv = mx.compile(mx.value_and_grad(lambda h: (output_cross_entropy(h, OutputWeights(model.tok_embeddings), t1) * c).sum()))
bench("output projection + cross-entropy, fwd + bwd", lambda: mx.eval(hv(h)))
xs = mx.random.normal((B * T, 576)); xf = mx.random.normal((B * T, 1536)); mx.eval(xs, xf)
gm = mx.compile(lambda x, xf: [linear(xf if W.shape[1] == 1536 else x, W) for W in base_ws])  # training's GEMM path
bench("block GEMMs, forward (x2 = fwd + input grads)", lambda: mx.eval(gm(xs, xf)), scale=2)
q = mx.random.normal((B, 9, T, 64)); k = mx.random.normal((B, 3, T, 64)); v = mx.random.normal((B, 3, T, 64)); r = mx.random.normal(q.shape)
mx.eval(q, k, v, r)
ag = mx.compile(mx.grad(lambda q, k, v: (attention(q, k, v, 0.125, "causal") * r).sum(), argnums=(0, 1, 2)))
bench("attention fwd + bwd (x30 layers)", lambda: mx.eval(ag(q, k, v)), scale=30)
g = mx.random.normal((B * T, 1536)); u = mx.random.normal((B * T, 1536)); mx.eval(g, u)
sg = mx.compile(mx.grad(lambda g, u: (swiglu(g, u) * xf).sum(), argnums=(0, 1)))
bench("SwiGLU elementwise fwd + bwd (x30)", lambda: mx.eval(sg(g, u)), scale=30)
nw = mx.ones((576,)); rr = mx.random.normal((B * T, 576)); mx.eval(nw, rr)
ng = mx.compile(mx.grad(lambda x: (rms_norm(x, nw, 1e-5) * rr).sum()))
bench("RMSNorm fwd + bwd (x60)", lambda: mx.eval(ng(xs)), scale=60)
