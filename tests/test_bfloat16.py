"""bfloat16, the compute dtype on a GPU: the base weights in bfloat16, while the adapters, the
optimizer state and the loss stay float32, on the kernels' path and on the MLX-only path
(MLXTOY_KERNELS=0, what Metal and CUDA run). The float32 run of the same job is the reference."""

from __future__ import annotations

import mlx.core as mx
import pytest

from helpers_train import qa_rows, run_cli, write_jsonl, write_tiny_model_folder
from mlxtoy.rundir import read_metrics
from mlxtoy.train.checkpoint import load_checkpoint

STEPS = 6
# bfloat16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2%) in the base weights and the
# activations; over 6 LoRA steps of the tiny model the loss stays within 1% of float32's
# (measured: <= 0.1%, the same with the kernels on and off)
TINY_TOLERANCE = 0.01


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(64, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(8, seed=2))
    return {"model": write_tiny_model_folder(str(root / "model")), "data": str(data), "root": root}


def train_losses(model: str, data: str, out, dtype: str, kernels: str, steps: int = STEPS, batch: int = 2,
                 lr: float = 5e-3, extra: tuple[str, ...] = ()) -> list[float]:
    r = run_cli("train", "--model", model, "--data", data, "--out", str(out), "--method", "lora",
                "--steps", str(steps), "--batch-size", str(batch), "--seq-len", "64", "--lr", str(lr),
                "--eval-every", "0", "--eval-batches", "1", "--save-every", str(steps), "--dtype", dtype, "--seed", "0",
                "--device", "cpu", *extra, env={"MLXTOY_KERNELS": kernels})
    assert r.returncode == 0, r.stderr[-3000:]
    return [e["loss"] for e in read_metrics(str(out / "metrics.jsonl")) if e["event"] == "step"]


def assert_float32_state(run) -> None:
    _, trainable, optimizer = load_checkpoint(str(run / "checkpoints" / f"step_{STEPS}"))
    assert trainable and optimizer
    assert all("lora" in k for k in trainable), list(trainable)[:4]  # adapters only: the base is frozen
    assert {str(v.dtype) for v in trainable.values()} == {"mlx.core.float32"}
    assert {str(v.dtype) for v in optimizer.values() if mx.issubdtype(v.dtype, mx.floating)} == {"mlx.core.float32"}


@pytest.mark.core
@pytest.mark.parametrize("kernels", ["1", "0"])
def test_bfloat16_lora_keeps_float32_state_and_tracks_float32_loss(work, tmp_path, kernels):
    f32 = train_losses(work["model"], work["data"], tmp_path / "f32", "float32", kernels)
    bf16 = train_losses(work["model"], work["data"], tmp_path / "bf16", "bfloat16", kernels)
    assert len(f32) == len(bf16) == STEPS
    assert_float32_state(tmp_path / "bf16")
    assert_float32_state(tmp_path / "f32")
    gaps = [abs(b - f) / f for b, f in zip(bf16, f32)]
    assert max(gaps) < TINY_TOLERANCE, (f32, bf16)
    assert max(gaps) > 0, "bfloat16 gave float32's losses bit for bit: was the base in bfloat16 at all?"
    assert bf16[-1] < bf16[0]  # and it learns
    config = (tmp_path / "bf16" / "config.yaml").read_text()
    assert "dtype: bfloat16" in config


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_bfloat16_lora_tracks_float32_on_the_mlx_only_path(smollm2_path, work, tmp_path):
    """SmolLM2 in bfloat16 on MLX's CPU, which has no fast bfloat16 matmul: this 2-step run of 1 x 64
    tokens took 28 s in bfloat16 against 14 s in float32 (load, compile and save included; 2 loaded
    cores), so it stays this small. The losses were 0.3% and 2.6% from float32's; the bound is 5%."""
    kw = dict(steps=2, batch=1, lr=1e-3, extra=("--lora-targets", "q,v"))
    f32 = train_losses(smollm2_path, work["data"], tmp_path / "f32", "float32", "0", **kw)
    bf16 = train_losses(smollm2_path, work["data"], tmp_path / "bf16", "bfloat16", "0", **kw)
    gaps = [abs(b - f) / f for b, f in zip(bf16, f32)]
    assert len(gaps) == 2 and max(gaps) < 0.05, (f32, bf16)
    assert max(gaps) > 0
