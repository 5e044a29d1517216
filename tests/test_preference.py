"""Preference training (DPO, ORPO): losses and gradients against an independent torch
implementation of the papers' formulas on a tiny HF model; the LoRA reference; packing,
resume and data-parallel equalities; bad input; the bundled pairs on SmolLM2."""

from __future__ import annotations

import io
import json
import os
import random
import time
from contextlib import redirect_stderr, redirect_stdout

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten

from helpers_train import REPO, run_cli, run_training, write_jsonl, write_tiny_model_folder
from mlxtoy.config import TrainConfig
from mlxtoy.loading import load
from mlxtoy.models.lora import LoRAHeadProjection, LoRALinear, apply_lora
from mlxtoy.rundir import REFERENCE_LOGPS, read_metrics
from mlxtoy.train.control import TrainControl
from mlxtoy.train.data import Renderer
from mlxtoy.train.records import read_data
from mlxtoy.train.job import resume_config
from mlxtoy.train.preference import PreferenceSpec, pair_logps, preference_loss
from mlxtoy.train.pairs import PairStream, tokenize_pairs
from mlxtoy.train.step import pair_arrays

LOG2 = float(np.log(np.float32(2.0)))


def pair_rows(n: int, seed: int, conversational: bool = False) -> list[dict]:
    """'add one' as pairs, prompts and completions of varied lengths."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.randrange(10, 10 ** rng.randrange(2, 5))
        prompt = f"{a}+1" + " please" * rng.randrange(3)
        chosen, rejected = str(a + 1), str(a + rng.choice([2, 3, -1])) + "0" * rng.randrange(3)
        if conversational:
            head = [{"role": "user", "content": prompt}]
            rows.append({"chosen": head + [{"role": "assistant", "content": chosen}],
                         "rejected": head + [{"role": "assistant", "content": rejected}]})
        else:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    model = write_tiny_model_folder(str(root / "model"))
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), pair_rows(48, seed=1))
    write_jsonl(str(data / "valid.jsonl"), pair_rows(8, seed=2, conversational=True))
    return {"root": root, "model": model, "data": str(data)}


def cfg_for(work, out, **kw) -> TrainConfig:
    base = dict(model=work["model"], data=work["data"], out=str(out), method="lora", objective="dpo",
                steps=6, batch_size=4, seq_len=64, lr=5e-3, eval_every=3, eval_batches=2, save_every=0,
                lora_targets=["q", "v", "down"], seed=0)
    base.update(kw)
    return TrainConfig(**base)


def events(run, kind: str) -> list[dict]:
    return [e for e in read_metrics(os.path.join(str(run), "metrics.jsonl")) if e["event"] == kind]


# ------------------------------------------------------------------ losses vs torch (the papers)


def torch_logps(hf_model, pairs) -> tuple[torch.Tensor, ...]:
    """Per pair: summed and mean completion log-probs (chosen, rejected) and the chosen
    completion token count, each sequence run alone through transformers."""
    sums, means, counts = [], [], []
    for p in pairs:
        row = []
        for ex in (p.chosen, p.rejected):
            ids = torch.tensor(ex.tokens.astype(np.int64))[None]
            logp = torch.log_softmax(hf_model(ids).logits[0, :-1].double(), -1)
            picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(ex.loss[1:].astype(np.float64))
            row.append(((picked * mask).sum(), mask.sum()))
        sums.append(torch.stack([row[0][0], row[1][0]]))
        means.append(torch.stack([row[0][0] / row[0][1], row[1][0] / row[1][1]]))
        counts.append(row[0][1])
    return torch.stack(sums), torch.stack(means), torch.stack(counts)


def torch_dpo(lp, ref, beta, eps):
    # Rafailov et al. (2023), eq. 7; conservative DPO's label smoothing eps
    z = beta * ((lp[:, 0] - ref[:, 0]) - (lp[:, 1] - ref[:, 1]))
    return (-(1 - eps) * torch.nn.functional.logsigmoid(z) - eps * torch.nn.functional.logsigmoid(-z)).mean()


def torch_orpo(lp, mean, n_chosen, beta):
    # Hong et al. (2024), eq. 6-8: odds(y|x) = P / (1 - P) with P the mean per-token likelihood
    p = mean.exp()
    log_odds = torch.log(p / (1 - p))
    l_or = -torch.log(torch.sigmoid(log_odds[:, 0] - log_odds[:, 1]))
    nll = -lp[:, 0].sum() / n_chosen.sum()
    return nll + beta * l_or.mean()


HF_NAMES = {"layers.0.ffn.down.weight": "model.layers.0.mlp.down_proj.weight",
            "layers.1.attn.o.weight": "model.layers.1.self_attn.o_proj.weight",
            "layers.1.ffn.up.weight": "model.layers.1.mlp.up_proj.weight"}


@pytest.mark.parametrize("objective,eps", [("dpo", 0.0), ("dpo", 0.2), ("orpo", 0.0)])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.core
def test_loss_and_gradients_equal_torch(work, objective, eps, packed):
    """A batch of 5 pairs (prompts and completions of different lengths; one padded short
    batch) through our objective vs transformers + the papers' formulas in torch."""
    from transformers import AutoModelForCausalLM

    model, tok = load(work["model"])
    raw = read_data(work["data"])
    pairs, _ = tokenize_pairs(raw.train[:5], tok, 64)
    assert len({len(p.chosen) for p in pairs}) > 2 and len({len(p.rejected) for p in pairs}) > 2
    ref = np.random.default_rng(0).normal(-12, 2, (5, 2)).astype(np.float32)
    batch = PairStream(pairs, 5, 64, pack=packed, shuffle=False, ref=ref).batch(0)
    assert batch.inputs.shape[0] == (5 if packed else 10)
    beta = 0.3
    spec = PreferenceSpec(objective, beta, eps)
    norms = mx.array([5.0, float(batch.n_chosen)])

    def fn(m):
        return preference_loss(m, spec, *pair_arrays(batch, packed), norms)

    (loss, stats), grads = nn.value_and_grad(model, fn)(model)
    grads = dict(tree_flatten(grads))

    hf = AutoModelForCausalLM.from_pretrained(work["model"], torch_dtype=torch.float64)
    lp, mean, n_chosen = torch_logps(hf, pairs)
    if objective == "dpo":
        t_loss = torch_dpo(lp, torch.tensor(ref, dtype=torch.float64), beta, eps)
        t_rc = beta * (lp[:, 0] - torch.tensor(ref[:, 0], dtype=torch.float64))
        t_rr = beta * (lp[:, 1] - torch.tensor(ref[:, 1], dtype=torch.float64))
    else:
        t_loss = torch_orpo(lp, mean, n_chosen, beta)
        t_rc, t_rr = beta * mean[:, 0], beta * mean[:, 1]
    t_loss.backward()
    np.testing.assert_allclose(loss.item(), t_loss.item(), rtol=2e-5)
    np.testing.assert_allclose(np.array(stats), [t_loss.item(), t_rc.mean().item(), t_rr.mean().item(),
                                                 (t_rc > t_rr).double().mean().item()], rtol=2e-4, atol=2e-5)
    params = dict(hf.named_parameters())
    for ours, theirs in HF_NAMES.items():
        g, tg = np.array(grads[ours]), params[theirs].grad.numpy()
        assert np.abs(tg).max() > 1e-6  # a real gradient, not zeros on both sides
        np.testing.assert_allclose(g, tg, rtol=0, atol=2e-4 * np.abs(tg).max(), err_msg=ours)


def test_lora_reference_is_the_base_model(work):
    """With trained (non-zero) adapters, the in-graph reference (adapters switched off) gives
    the loss that a separately loaded base model's log-probs give."""
    model, tok = load(work["model"])
    base, _ = load(work["model"])
    mx.random.seed(3)  # the adapters' A matrices: fixed, whatever ran before
    apply_lora(model, ["q", "v", "down"], rank=2, alpha=4)
    for i, (_, m) in enumerate(model.named_modules()):
        if isinstance(m, (LoRAHeadProjection, LoRALinear)):
            m.lora_b = 1.0 * mx.random.normal(m.lora_b.shape, key=mx.random.key(i))
    pairs, _ = tokenize_pairs(read_data(work["data"]).train[:4], tok, 64)
    batch = PairStream(pairs, 4, 64, shuffle=False).batch(0)
    args = pair_arrays(batch, True)
    ref = pair_logps(base, *args[:5], 4)
    norms = mx.array([4.0, float(batch.n_chosen)])
    in_graph = preference_loss(model, PreferenceSpec("dpo", 0.1, adapters_reference=True), *args, norms)[1]
    stored = preference_loss(model, PreferenceSpec("dpo", 0.1), *args[:5], ref, norms)[1]
    np.testing.assert_allclose(np.array(in_graph), np.array(stored), rtol=1e-5, atol=1e-6)
    assert abs(in_graph[1].item()) > 1e-2  # the adapters moved the policy away from the reference
    # and the adapters come back on: the policy is not the base
    assert not np.allclose(np.array(pair_logps(model, *args[:5], 4)), np.array(ref))


# ------------------------------------------------------------------ the trainer


def test_lora_dpo_step0_is_log2_with_zero_rewards(work, tmp_path):
    res = run_training(cfg_for(work, tmp_path / "run", steps=2), handle_sigint=False)
    assert res.reason == "finished"
    first = events(tmp_path / "run", "step")[0]
    assert first["loss"] == pytest.approx(LOG2, abs=0, rel=1e-7) and first["loss"] == float(np.float32(LOG2))
    assert first["reward_chosen"] == 0.0 and first["reward_rejected"] == 0.0 and first["reward_margin"] == 0.0
    assert first["pref_accuracy"] == 0.0  # ties are not wins
    ev0 = events(tmp_path / "run", "eval")[0]
    assert ev0["step"] == 0 and ev0["val_loss"] == pytest.approx(LOG2, rel=1e-7) and ev0["reward_margin"] == 0.0
    # positive control: after a step the rewards move
    assert events(tmp_path / "run", "step")[1]["reward_margin"] != 0.0


def _same_runs(a, b, atol):
    for key in ("loss", "reward_chosen", "reward_rejected", "pref_accuracy"):
        np.testing.assert_allclose([e[key] for e in events(a, "step")], [e[key] for e in events(b, "step")],
                                   atol=atol, rtol=0, err_msg=key)
    for key in ("val_loss", "pref_accuracy", "reward_margin"):
        np.testing.assert_allclose([e[key] for e in events(a, "eval")], [e[key] for e in events(b, "eval")],
                                   atol=atol, rtol=0, err_msg=key)


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
@pytest.mark.core
def test_packed_equals_unpacked_and_accumulated(work, tmp_path, objective):
    """--pack (one row per pair) == --no-pack (a row per completion) == 2 micro-batches of 2."""
    runs = {"packed": {}, "padded": {"pack": False}, "accum": {"batch_size": 2, "grad_accum": 2}}
    for name, kw in runs.items():
        assert run_training(cfg_for(work, tmp_path / name, objective=objective, steps=4, eval_every=2,
                                    eval_batches=-1, **kw),
                            handle_sigint=False).reason == "finished"
    _same_runs(tmp_path / "packed", tmp_path / "padded", 2e-5)
    _same_runs(tmp_path / "packed", tmp_path / "accum", 2e-5)
    wa = mx.load(str(tmp_path / "packed" / "adapters.safetensors"))
    wb = mx.load(str(tmp_path / "padded" / "adapters.safetensors"))
    for k in wa:
        np.testing.assert_allclose(np.array(wa[k]), np.array(wb[k]), atol=2e-5, rtol=0, err_msg=k)


@pytest.mark.parametrize("method,objective", [("full", "dpo"), ("lora", "orpo")])
@pytest.mark.core
def test_resume_equals_uninterrupted(work, tmp_path, method, objective):
    kw = dict(method=method, objective=objective, steps=6, grad_accum=2, lr=2e-3 if method == "full" else 5e-3,
              eval_every=3, warmup=1)
    full = run_training(cfg_for(work, tmp_path / "full", **kw), handle_sigint=False)
    part = run_training(cfg_for(work, tmp_path / "part", **kw), control=TrainControl(stop_at=3),
                        handle_sigint=False)
    assert part.reason == "stopped" and part.step == 3
    ref_file = tmp_path / "part" / REFERENCE_LOGPS
    assert ref_file.exists() == (method == "full")
    before = ref_file.read_bytes() if ref_file.exists() else None
    rest = run_training(resume_config(str(tmp_path / "part"), {}), resume=True, handle_sigint=False)
    assert rest.reason == "finished" and rest.step == 6 and full.reason == "finished"
    _same_runs(tmp_path / "part", tmp_path / "full", 1e-6)
    if method == "full":  # reused, not recomputed (the weights had moved)
        assert ref_file.read_bytes() == before
        logs = [e["message"] for e in events(tmp_path / "part", "log")]
        assert sum("reusing" in m for m in logs) == 1 and sum("of 56 pairs" in m for m in logs) == 1
        # the stored reference is the starting model's: the full run's step-1 loss is log 2
        assert events(tmp_path / "full", "step")[0]["loss"] == pytest.approx(LOG2, rel=1e-6)


def test_two_ranks_equal_one_process_for_dpo(work, tmp_path):
    from test_distributed import AUDIT, assert_same_run, launch

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AUDIT)
    w = dict(work, site=str(site))
    args = ["--model", work["model"], "--data", work["data"], "--method", "full", "--objective", "dpo",
            "--steps", "4", "--batch-size", "4", "--seq-len", "64", "--eval-every", "2", "--eval-batches", "2",
            "--save-every", "2", "--lr", "2e-3", "--seed", "0"]
    one = str(tmp_path / "one")
    r = run_cli("train", *args, "--out", one)
    assert r.returncode == 0, r.stderr
    two = str(tmp_path / "two")
    r = launch(w, [*args, "--out", two], timeout=300)
    assert r.returncode == 0 and '"world_size": 2' in r.stdout, r.stdout + r.stderr
    assert_same_run(two, one)
    _same_runs(two, one, 1e-5)
    assert os.path.exists(os.path.join(two, REFERENCE_LOGPS))


def test_taps_samples_accuracy_checkpoints_and_export_with_dpo(work, tmp_path):
    """Everything around training works with a preference objective: samples and taps from
    the pairs' prompts, held-out exact-match accuracy on a test split of pairs (the chosen
    answer is the expected one), checkpoints, and an export that transformers loads."""
    from transformers import AutoModelForCausalLM

    data = tmp_path / "data"
    for split, seed in (("train", 1), ("valid", 2), ("test", 3)):
        write_jsonl(str(data / f"{split}.jsonl"), pair_rows(16 if split == "train" else 4, seed))
    out = tmp_path / "run"
    r = run_cli("train", "--model", work["model"], "--data", str(data), "--out", str(out), "--objective", "dpo",
                "--steps", "4", "--batch-size", "2", "--seq-len", "64", "--sample-every", "2", "--sample-tokens", "4",
                "--taps-every", "2", "--save-every", "2", "--eval-every", "2", "--eval-accuracy")
    assert r.returncode == 0, r.stderr
    assert "held-out accuracy" in r.stdout and "margin" in r.stderr and "acc" in r.stderr
    assert len(events(out, "sample")) >= 2 and len(events(out, "taps")) == 2
    assert [e["step"] for e in events(out, "checkpoint")] == [2, 4]
    acc = json.load(open(out / "accuracy.json"))
    assert acc["before"]["total"] == 4 and acc["before"]["samples"][0]["expected"] == pair_rows(4, 3)[0]["chosen"]
    hf = tmp_path / "hf"
    r = run_cli("export", str(out), "--out", str(hf), "--format", "hf")
    assert r.returncode == 0, r.stderr
    model = AutoModelForCausalLM.from_pretrained(str(hf))
    assert model.config.num_hidden_layers == 2


# ------------------------------------------------------------------ data


def test_pair_masks_equal_sft_masks(work, tmp_path):
    """A pair's completion mask is SFT's mask of the same conversation; both record forms
    give the same tokens; the prompt never counts."""
    _, tok = load(work["model"])
    r = Renderer(tok)
    rows = [{"prompt": "12+1", "chosen": "13", "rejected": "140", "system": "be brief"}]
    head = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+1"}]
    conv = [{"chosen": head + [{"role": "assistant", "content": "13"}],
             "rejected": head + [{"role": "assistant", "content": "140"}]}]
    a = read_data(write_jsonl(str(tmp_path / "a.jsonl"), rows)).train
    b = read_data(write_jsonl(str(tmp_path / "b.jsonl"), conv)).train
    (pa,), _ = tokenize_pairs(a, tok, 64)
    (pb,), _ = tokenize_pairs(b, tok, 64)
    for side, text in (("chosen", "13"), ("rejected", "140")):
        ex_a, ex_b = getattr(pa, side), getattr(pb, side)
        assert ex_a.tokens.tolist() == ex_b.tokens.tolist() and ex_a.loss.tolist() == ex_b.loss.tolist()
        ids, loss = r.chat(head + [{"role": "assistant", "content": text}], "x")
        loss[0] = False
        assert ex_a.tokens.tolist() == ids and ex_a.loss.tolist() == loss
        trained = tok.decode([t for t, m in zip(ex_a.tokens.tolist(), ex_a.loss.tolist()) if m])
        assert trained.startswith(text) and "<|im_end|>" in trained and "12+1" not in trained


def _main(args):
    from mlxtoy.cli import main

    err, so = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(so):
        code = main(args)
    return code, err.getvalue().strip().splitlines()


def test_bad_input_one_error_line_exit_2(work, tmp_path):
    d = tmp_path / "bad"
    good = {"prompt": "1+1", "chosen": "2", "rejected": "3"}
    sft = {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}
    conv = lambda c, r: {"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": c}],  # noqa: E731
                         "rejected": [{"role": "user", "content": r}, {"role": "assistant", "content": "x"}]}
    cases = {
        "no_chosen": ([good, {"prompt": "a", "rejected": "b"}], [], "no_chosen.jsonl:2: missing field 'chosen'"),
        "no_rejected": ([{"prompt": "a", "chosen": "b"}], [], "no_rejected.jsonl:1: missing field 'rejected'"),
        "no_rejected_conv": ([{"chosen": sft["messages"]}], [], "no_rejected_conv.jsonl:1: missing field 'rejected'"),
        "identical": ([good, good, {"prompt": "a", "chosen": "b", "rejected": "b"}], [],
                      "identical.jsonl:3: 'chosen' and 'rejected' are identical"),
        "empty": ([{"prompt": "a", "chosen": "b", "rejected": "  "}], [], "empty.jsonl:1: empty completion in 'rejected'"),
        "empty_conv": ([conv("", "a")], [], "empty_conv.jsonl:1: empty completion in 'chosen'"),
        "prefix": ([conv("b", "other")], [], "prefix.jsonl:1: 'chosen' and 'rejected' must share every message"),
        "no_room": ([{"prompt": "z" * 80 + str(i), "chosen": "2", "rejected": "3"} for i in range(3)],
                    ["--seq-len", "32"], "no_room.jsonl: no preference pair fits --seq-len 32"),
        "sft_data": ([sft], [], "sft_data.jsonl:1: --objective dpo needs preference pairs"),
        "beta": ([good], ["--beta", "0"], "beta must be > 0"),
        "beta_neg": ([good], ["--beta=-0.5"], "beta must be > 0"),
        "smoothing": ([good], ["--label-smoothing", "1"], "label_smoothing must be in [0, 1)"),
        "smoothing_orpo": ([good], ["--label-smoothing", "0.1", "--objective", "orpo"],
                           "label_smoothing applies to objective dpo only"),
    }
    for name, (rows, extra, msg) in cases.items():
        path = write_jsonl(str(d / f"{name}.jsonl"), rows)
        out = tmp_path / f"out_{name}"
        code, lines = _main(["train", "--model", work["model"], "--data", path, "--out", str(out),
                             "--objective", "dpo", "--steps", "1", *extra])
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], (name, lines)
        assert not out.exists(), name
    # pairs under the default sft objective
    path = write_jsonl(str(d / "pairs.jsonl"), [good])
    code, lines = _main(["train", "--model", work["model"], "--data", path, "--out", str(tmp_path / "o")])
    assert code == 2 and lines == [f"error: {path}:1: preference pairs need --objective dpo or orpo "
                                   f"(the objective is sft)"], lines
    # the same through a real process: exit status 2, one line
    r = run_cli("train", "--model", work["model"], "--data", str(d / "identical.jsonl"), "--out",
                str(tmp_path / "p"), "--objective", "orpo")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "identical.jsonl:3:" in r.stderr, r.stderr
    # positive control: good pairs, plus one whose prompt is too long: dropped, counted, logged once
    short = [{"prompt": f"{i}+1", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(10, 22)]
    path = write_jsonl(str(d / "some.jsonl"), short + [{"prompt": "z" * 80, "chosen": "2", "rejected": "3"}])
    code, lines = _main(["train", "--model", work["model"], "--data", path, "--out", str(tmp_path / "ok"),
                         "--objective", "dpo", "--steps", "1", "--seq-len", "40", "--valid-fraction", "0",
                         "--eval-every", "0", "--batch-size", "2"])
    assert code == 0, lines
    # the warning (the data summary line also counts them, unwrapped since stderr lines are)
    dropped = [m for m in lines if m.startswith("warning:") and "dropped" in m and "leaves no room" in m]
    assert len(dropped) == 1 and "train: 1 preference pairs dropped" in dropped[0], lines


# ------------------------------------------------------------------ the bundled pairs, SmolLM2


def pairwise_accuracy(model, tok, rows: list[dict]) -> float:
    """Share of pairs with log p(chosen | prompt) > log p(rejected | prompt): the prompt and
    the answers rendered with the tokenizer's template, log-softmax in numpy (not the
    trainer's code)."""
    seqs, spans = [], []
    for r in rows:
        msgs = [{"role": "system", "content": r["system"]}, {"role": "user", "content": r["prompt"]}]
        p = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
        for ans in (r["chosen"], r["rejected"]):
            full = tok.encode(tok.apply_chat_template(msgs + [{"role": "assistant", "content": ans}]))
            assert full[: len(p)] == p
            seqs.append(full)
            spans.append(len(p))
    width = max(map(len, seqs))
    x = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = s  # right padding: causal attention never looks at it
    scores = []
    for lo in range(0, len(seqs), 16):
        logits = np.array(model(mx.array(x[lo: lo + 16])).astype(mx.float32), dtype=np.float64)
        logits -= logits.max(-1, keepdims=True)
        lsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        for i in range(lo, min(lo + 16, len(seqs))):
            s = seqs[i]
            scores.append(sum(lsm[i - lo, t - 1, s[t]] for t in range(spans[i], len(s))))
    return float(np.mean([scores[2 * k] > scores[2 * k + 1] for k in range(len(rows))]))


@pytest.fixture(scope="module")
def held_out(smollm2_path):
    """The first 40 pairs of assets/pref/test.jsonl and the base model's pairwise accuracy."""
    rows = [json.loads(line) for line in open(os.path.join(REPO, "assets", "pref", "test.jsonl"))][:40]
    model, tok = load(smollm2_path)
    return rows, pairwise_accuracy(model, tok, rows)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_smollm2_pairs_raise_held_out_pair_accuracy(tmp_path, smollm2_path, held_out, objective):
    """LoRA DPO / ORPO on assets/pref lifts held-out pairwise accuracy to >= 90% in 8 steps."""
    rows, before = held_out
    out = tmp_path / objective
    t0 = time.time()
    r = run_cli("train", "--model", smollm2_path, "--data", os.path.join(REPO, "assets", "pref"), "--out", str(out),
                "--objective", objective, "--steps", "8", "--batch-size", "4", "--seq-len", "64", "--lr", "1e-3",
                "--lora-targets", "q,v,o,down", "--eval-every", "0", "--eval-batches", "1", "--save-every", "0",
                timeout=1200)
    wall = time.time() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    model, tok = load(smollm2_path, adapter=str(out))
    after = pairwise_accuracy(model, tok, rows)
    print(f"{objective}: held-out pair accuracy {before:.1%} -> {after:.1%}, 8 steps, {wall:.0f}s")
    assert after >= 0.9 and after > before, (before, after)
