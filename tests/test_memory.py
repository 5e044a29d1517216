"""The memory guard (mlxtoy.train.memory): the estimate against MLX's measured peak around real
training steps (the job's prepare, the loop's compiled Stepper), on SmolLM2 and a synthetic
model; the warning with settings that fit; --strict-memory through the real CLI."""

from __future__ import annotations

import gc
import io
import re
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from helpers_train import REPO, run_cli, write_jsonl, write_tiny_model_folder, qa_rows
from mlxtoy import backend
from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.events import MetricsSink, fan_out
from mlxtoy.train import grpo, memory
from mlxtoy.train.job import load_parts, prepare
from mlxtoy.train.loop import train
from mlxtoy.train.objectives import GRPO

TOLERANCE = 0.25  # the acceptance bound: |estimate / measured - 1|


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("mem")
    model = write_tiny_model_folder(str(root / "model"))
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(60, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(8, seed=2))
    return {"root": root, "model": model, "data": str(data)}


class Measured(Exception):
    """Raised after the first step: what follows (evaluation, final weights) is not measured."""


def first_step_peak(cfg: TrainConfig):
    """(the prepared job, the memory held before it, MLX's peak over cfg's first training step):
    the job prepares (and estimates), the loop trains; MLX's peak is reset when the loop starts
    (model loaded, optimizer initialised) and read after the step."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    p = prepare(cfg)
    peaks = []

    def on_event(ev):
        if ev.event == "start":
            mx.clear_cache()
            mx.reset_peak_memory()
        elif ev.event == "step":
            peaks.append(mx.get_peak_memory())
            if not cfg.method == "scratch":  # scratch runs go on: their weights are a model
                raise Measured

    try:
        train(p.cfg, p.model, p.tokenizer, p.dataset, p.run, facts=p.facts, objective=p.objective,
              emit=fan_out(MetricsSink(p.run), on_event), handle_sigint=False)
    except Measured:
        pass
    finally:
        p.run.unlock()
    return p, before, max(peaks)


def measured_peak(cfg: TrainConfig) -> tuple[int, int]:
    """(estimated, measured) peak bytes of cfg's first training step, less what was held before
    it (earlier tests')."""
    p, before, peak = first_step_peak(cfg)
    return p.memory.estimate.peak, peak - before


def quick(cfg: TrainConfig) -> TrainConfig:
    """One step, no evaluation before it, one validation batch after it, no checkpoint."""
    return replace(cfg, steps=1, eval_every=0, eval_batches=1, save_every=0, sample_every=0, warmup=0)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("method,batch", [("lora", 1), ("lora", 4), ("full", 1), ("full", 4)])
def test_estimate_within_25_percent_on_smollm2(tmp_path, method, batch):
    cfg = quick(TrainConfig(model="smollm2-135m", data=f"{REPO}/assets/demo", out=str(tmp_path / "r"),
                            method=method, batch_size=batch, seq_len=128, lora_targets=["q", "v"]))
    est, got = measured_peak(cfg)
    print(f"smollm2 {method} batch {batch} x 128: estimate {est / 1e9:.3f} GB, measured {got / 1e9:.3f} GB, "
          f"ratio {est / got:.3f}")
    assert abs(est / got - 1) <= TOLERANCE, (est, got)


class PhasePeaks:
    """MLX's peaks of a GRPO step's two moments, read around `grpo.generate_batch`: the
    batched decoding (its rollout) and what follows it (scoring, the update)."""

    def __init__(self, monkeypatch):
        self.generation: list[int] = []
        original = getattr(grpo.generate_batch, "__wrapped__", grpo.generate_batch)  # (an earlier run's wrap)

        def generate_batch(*args, **kw):
            mx.synchronize()
            mx.reset_peak_memory()
            out = original(*args, **kw)
            self.generation.append(mx.get_peak_memory())
            mx.reset_peak_memory()  # the step event's peak: the update's moment
            return out

        generate_batch.__wrapped__ = original
        monkeypatch.setattr(grpo, "generate_batch", generate_batch)


def grpo_peaks(cfg: TrainConfig, monkeypatch) -> tuple[memory.MemoryEstimate, int, int, int]:
    """(the estimate, the measured peak of the decoding, of the rest of the step, the
    estimated peak with rows as wide as seq_len allows) of cfg's first GRPO step, measured as
    `measured_peak` measures."""
    phases = PhasePeaks(monkeypatch)
    p, before, peak = first_step_peak(cfg)
    p.objective.longest_prompt = 0  # as before the prompts are tokenized: seq_len bounds them
    wide = memory.estimate(cfg, p.model, p.objective).peak
    return p.memory.estimate, phases.generation[0] - before, peak - before, wide


@pytest.mark.real
@pytest.mark.slow
def test_grpo_estimate_within_25_percent_on_smollm2(tmp_path, monkeypatch):
    """GRPO on SmolLM2 (LoRA q, v; 16 completion tokens; seq_len 512 as the default, the
    prompts ~50 tokens): group 8 x batch 4 with a KL term (the issue's run, the update's
    moment the peak), and group 8 x batch 1 x 8 micro-batches (one generation of 64 rows: the
    decoding's moment the peak). The step's estimated peak and the decoding's against MLX's."""
    base = dict(model="smollm2-135m", data=f"{REPO}/assets/grpo", objective="grpo", method="lora",
                reward=f"{REPO}/assets/grpo/reward.py:date_parts", lora_targets=["q", "v"], group_size=8,
                max_completion_tokens=16, seq_len=512)
    runs = {"batch 4, beta 0.04": dict(batch_size=4, beta=0.04),
            "batch 1 x 8 micro-batches": dict(batch_size=1, grad_accum=8)}
    got = {}
    for name, kw in runs.items():
        cfg = quick(TrainConfig(out=str(tmp_path / name.replace(" ", "-")), **base, **kw))
        est, generation, update, wide = grpo_peaks(cfg, monkeypatch)
        got[name] = generation, update, wide
        peak = max(generation, update)
        print(f"smollm2 grpo {name}: estimate {est.peak / 1e9:.3f} GB (decoding {est.generation / 1e9:.3f}), "
              f"measured {peak / 1e9:.3f} GB (decoding {generation / 1e9:.3f}, update {update / 1e9:.3f}), "
              f"ratio {est.peak / peak:.3f} (decoding {est.generation / generation:.3f})")
        assert abs(est.peak / peak - 1) <= TOLERANCE, (name, est, generation, update)
        assert abs(est.generation / generation - 1) <= TOLERANCE, (name, est, generation)
    # positive controls: each moment is the peak in one run, so each is what the check held
    # to the tolerance; and rows as wide as seq_len (what the estimate knows before the
    # prompts are tokenized, and the error) are far outside it
    (gen_a, upd_a, wide_a), (gen_b, upd_b, _) = got.values()
    assert upd_a > gen_a and gen_b > upd_b
    assert wide_a / upd_a - 1 > 2 * TOLERANCE, (wide_a, upd_a)


def synthetic(work, tmp_path, **kw) -> TrainConfig:
    """A from-scratch model big enough that activations, not fixed costs, dominate the peak."""
    base = dict(method="scratch", model=work["model"], data=work["data"], out=str(tmp_path / "r"), d_model=256,
                n_layers=4, n_heads=4, n_kv_heads=2, d_head=64, d_ff=688, batch_size=8, seq_len=256)
    base.update(kw)
    return quick(TrainConfig(**base))


def test_estimate_follows_grad_checkpoint_on_a_synthetic_model(work, tmp_path):
    """From scratch (every weight trains), then LoRA on that model (frozen blocks: here
    checkpointing saves most), then QLoRA (its projections quantized at load), each with
    --grad-checkpoint off and on."""
    from mlxtoy.export import export

    figures = {}
    for method in ("scratch", "lora", "qlora"):  # qlora: LoRA on that model quantized at load, 4-bit
        for ckpt in (False, True):
            out = tmp_path / f"{method}-{ckpt}"
            # (lora_targets only where adapters train: the config refuses it for scratch)
            kw = {"model": str(tmp_path / "hf"), "lora_targets": ["q", "v", "down"]} if method != "scratch" else {}
            if method != "scratch" and not (tmp_path / "hf").exists():
                export(str(tmp_path / "scratch-False" / "r"), str(tmp_path / "hf"), "hf", "f32")
            if method == "qlora":
                kw.update(method="lora", qlora="on")
            figures[method, ckpt] = measured_peak(synthetic(work, out, grad_checkpoint=ckpt,
                                                            **({"method": method} | kw)))
    for (method, ckpt), (est, got) in figures.items():
        print(f"synthetic d 256 x 4 layers, {method}, batch 8 x 256, grad_checkpoint {ckpt}: "
              f"estimate {est / 1e6:.0f} MB, measured {got / 1e6:.0f} MB, ratio {est / got:.3f}")
        assert abs(est / got - 1) <= TOLERANCE, (method, ckpt, est, got)
    for method in ("scratch", "lora", "qlora"):  # all move the same way
        (est_off, got_off), (est_on, got_on) = figures[method, False], figures[method, True]
        assert got_on < got_off and est_on < est_off, method
    # frozen blocks: a real saving (smaller since the block attention keeps no probabilities:
    # 0.83-0.86 of the peak without checkpointing measured)
    assert figures["lora", True][1] < 0.9 * figures["lora", False][1]


def test_optimizer_state_follows_the_optimizer(work, tmp_path):
    cfg = synthetic(work, tmp_path, optimizer="adamw")
    p = prepare(cfg)
    p.run.unlock()
    trainable = sum(v.nbytes for _, v in tree_flatten(p.model.trainable_parameters()))
    sizes = {name: memory.estimate(replace(cfg, optimizer=name), p.model).optimizer
             for name in ("adamw", "adam", "sgd", "lion", "muon", "adafactor")}
    assert sizes["adamw"] == sizes["adam"] == 2 * trainable
    assert sizes["sgd"] == sizes["lion"] == trainable
    assert trainable < sizes["muon"] < 2 * trainable  # AdamW on the embeddings and norms
    assert sizes["adafactor"] < trainable / 10  # factored: a row and a column per matrix
    assert memory.estimate(replace(cfg, optimizer="sgd", momentum=0.0), p.model).optimizer == 0


def _estimate_for(work, tmp_path, batch: int, seq_len: int = 256):
    """The tiny model's config and model as the job builds them (nothing written)."""
    cfg = TrainConfig(model=work["model"], data=work["data"], out=str(tmp_path / "probe"), batch_size=batch,
                      seq_len=seq_len)
    return cfg, load_parts(cfg)[0]


def test_a_run_that_does_not_fit_warns_with_settings_that_fit(work, tmp_path, monkeypatch):
    from mlxtoy.cli import main

    # The estimate before a run takes an unmeasured attention shape as the block form; the run then
    # measures it, and where another form wins (it keeps the scores) the estimate after grows. This
    # test is about the suggestions, not the route: pin the form so both estimates agree.
    monkeypatch.setenv("MLXTOY_BLOCK_ATTENTION", "1")
    cfg, model = _estimate_for(work, tmp_path, 40)
    need = memory.estimate(cfg, model).peak
    have = memory.estimate(replace(cfg, batch_size=24), model).peak + 1  # batch 24 fits, 25 does not
    assert have < need < memory.REFUSE_FACTOR * have  # over, but only a warning
    monkeypatch.setattr(backend.INFO, "memory_budget", lambda: (have, "physical memory"))
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        code = main(["train", "--model", work["model"], "--data", work["data"], "--out", str(tmp_path / "run"),
                     "--batch-size", "40", "--seq-len", "256", "--steps", "1", "--eval-every", "0"])
    text = " ".join(err.getvalue().split())  # rich wraps long lines
    assert code == 0, text
    assert "memory: estimated peak" in text
    warning = re.search(r"warning: this run may not fit in memory.*?settings that fit: (.*?)(?: step|$)", text)
    assert warning, text
    b = int(re.search(r"--batch-size (\d+) \(", warning.group(1)).group(1))
    assert b == 24 and memory.estimate(replace(cfg, batch_size=b), model).peak <= have
    accum = re.search(r"--batch-size (\d+) --grad-accum (\d+) \(the same effective batch", warning.group(1))
    assert accum and int(accum.group(1)) * int(accum.group(2)) == 40
    assert memory.estimate(replace(cfg, batch_size=int(accum.group(1)), grad_accum=int(accum.group(2))),
                           model).peak <= have
    assert "--grad-checkpoint" in warning.group(1)
    # the warning is an event too (metrics.jsonl, the TUI's log)
    assert "this run may not fit" in (tmp_path / "run" / "metrics.jsonl").read_text()


def test_strict_memory_is_an_error_through_the_cli(work, tmp_path):
    out = tmp_path / "strict"
    r = run_cli("train", "--model", work["model"], "--data", work["data"], "--out", str(out), "--steps", "1",
                "--seq-len", "256", "--strict-memory", env={memory.MEMORY_ENV: "0.001"})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: this run does not fit in memory"), lines
    assert f"{memory.MEMORY_ENV} 0.0 GB" in lines[0]
    assert not out.exists()
    # without --strict-memory a run over the figure (but not over twice it) warns and trains
    cfg, model = _estimate_for(work, tmp_path, 2, 64)
    figure = 0.8 * memory.estimate(cfg, model).peak / 1e9
    ok = run_cli("train", "--model", work["model"], "--data", work["data"], "--out", str(tmp_path / "warn"),
                 "--steps", "1", "--seq-len", "64", "--batch-size", "2", "--eval-every", "0",
                 env={memory.MEMORY_ENV: f"{figure:.6f}"})
    assert ok.returncode == 0, ok.stderr
    assert "warning: this run may not fit in memory" in " ".join(ok.stderr.split())


def test_grpo_preflight_measures_prompts_before_refusing(work, tmp_path, monkeypatch):
    """Before the prompts are tokenized, seq_len bounds GRPO's rows (here 512 against prompts of
    a few tokens): the header's check, about to refuse a --strict-memory run on that bound,
    measures the prompts and checks what the data holds. A budget between the two estimates
    passes; one under the measured estimate is still refused before the weights load; with the
    measurement left out (the code before it) the first budget is refused (positive control)."""
    data = write_jsonl(str(tmp_path / "grpo.jsonl"), [{"prompt": f"{a}+1", "answer": str(a + 1)}
                                                      for a in range(10, 30)])
    cfg = TrainConfig(model=work["model"], data=data, out=str(tmp_path / "r"), method="lora", objective="grpo",
                      reward="exact", lora_targets=["q", "v"], batch_size=2, group_size=4,
                      max_completion_tokens=8, seq_len=512, strict_memory=True)
    model, _, _, _, objective = load_parts(replace(cfg, strict_memory=False))
    assert 0 < objective.longest_prompt < 32
    narrow = memory.estimate(cfg, model, objective).peak
    objective.longest_prompt = 0  # as the preflight starts: seq_len bounds the prompts
    wide = memory.estimate(cfg, model, objective).peak
    assert wide > 2 * narrow, (narrow, wide)
    budget = (narrow + wide) // 2
    monkeypatch.setattr(backend.INFO, "memory_budget", lambda: (budget, "physical memory"))
    objective = load_parts(cfg)[4]  # the header's check passes on the measured prompts
    assert memory.check_memory(cfg, model, objective).fits
    monkeypatch.setattr(GRPO, "memory_measure", lambda self, raw, tokenizer: False)
    with pytest.raises(UserError, match="this run does not fit in memory"):
        load_parts(cfg)  # positive control: the seq_len bound alone refuses this budget
    monkeypatch.undo()
    monkeypatch.setattr(backend.INFO, "memory_budget", lambda: (narrow - 1, "physical memory"))
    loaded = []
    monkeypatch.setattr("mlxtoy.train.job.build_model", lambda *a, **kw: loaded.append(1))
    with pytest.raises(UserError, match="this run does not fit in memory"):
        load_parts(cfg)  # measured and still over: refused from the header, nothing loaded
    assert not loaded
