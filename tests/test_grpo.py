"""GRPO: advantages, every loss type and importance level, the KL term and their gradients
against an independent torch implementation of TRL's documented formulas; the ratio at the
first iteration; rewards (built-ins, a user's file, one error line when it raises); a constant
reward trains nothing; resume equals an uninterrupted run; batched generation equals one
prompt at a time; and the house rule that nothing outside the objectives' home branches on
the objective's name."""

from __future__ import annotations

import io
import os
import random
import re
from contextlib import redirect_stderr, redirect_stdout

import mlx.core as mx
import numpy as np
import pytest
import torch

from helpers_train import REPO, run_cli, run_training, tiny_model, write_jsonl, write_tiny_model_folder
from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.engine import generate_batch
from mlxtoy.generate import generate_tokens
from mlxtoy.rundir import read_metrics
from mlxtoy.sampling import SamplingParams
from mlxtoy.train.control import TrainControl
from mlxtoy.train.grpo import GRPOSpec, group_advantages, grpo_loss
from mlxtoy.train.job import resume_config
from mlxtoy.train.logprobs import completion_logps, token_losses
from mlxtoy.train.rewards import RewardSet, split_specs

# ------------------------------------------------------------------ the house rule

HOME = {os.path.join("mlxtoy", "train", name) for name in ("objectives.py", "preference.py", "grpo.py", "rewards.py")}
BRANCH = re.compile(r"""objective["']?\]?\)?\s*(==|!=|(not\s+)?in\s*[(\[{])|in\s+PREFERENCE_OBJECTIVES""")


def objective_branches(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if BRANCH.search(line)]


def test_no_objective_branch_outside_its_home():
    # positive controls: the check sees the branches the objectives replaced
    for planted in ('if cfg.objective == "dpo" and not cfg.adapters:', "pairs = objective in (\"dpo\", \"orpo\")",
                    'self.config.get("objective") in ("dpo", "orpo")', "return self.objective in PREFERENCE_OBJECTIVES",
                    "if objective != 'sft':"):
        assert objective_branches(planted), planted
    for fine in ("objective = make_objective(cfg)", "self.objective.loss(model, *args)", "OBJECTIVES = ('sft',)"):
        assert not objective_branches(fine), fine
    found = {}
    for top in ("mlxtoy", "tui"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, REPO)
                if name.endswith(".py") and rel not in HOME:
                    hits = objective_branches(open(path, encoding="utf-8").read())
                    if hits:
                        found[rel] = hits
    assert not found, f"branches on the objective's name outside {sorted(HOME)}: {found}"


# what renders a run's events: the CLI's progress display and the TUI (but its setup form, which
# edits the config, whose fields include GRPO's `reward`)
DISPLAY = [os.path.join("mlxtoy", "commands", "train.py")] + sorted(
    os.path.join("tui", name) for name in os.listdir(os.path.join(REPO, "tui"))
    if name.endswith(".py") and name != "setup.py")


def objective_own_names() -> set[str]:
    """What only some objectives' events carry: every value an objective declares beyond the
    base's, and their loss statistics."""
    from mlxtoy.train import grpo, preference
    from mlxtoy.train.objectives import OBJECTIVE_TYPES, Objective

    base = {m.key for m in Objective.step_shows + Objective.eval_shows}
    declared = {m.key for kind in OBJECTIVE_TYPES.values() for m in kind.step_shows + kind.eval_shows}
    return (declared | set(grpo.STATS) | set(preference.STATS)) - base


def field_reads(text: str, names: set[str]) -> list[str]:
    """Lines naming one of `names` as a string or an attribute: code that reads an objective's
    own value instead of rendering the declaration."""
    pattern = re.compile("|".join(rf"""["']{re.escape(n)}["']|\.{re.escape(n)}\b""" for n in sorted(names)))
    return [line.strip() for line in text.splitlines() if pattern.search(line)]


def test_display_renders_the_declaration_not_the_objective_fields():
    """The Train and Runs screens and the CLI's progress render each objective's declared
    metrics (Objective.step_shows / eval_shows); none reads an objective's own event fields to
    decide what to show (the Train screen's charts once did: a reward chart when a step
    carried `reward`, a pairs chart when it carried `pref_accuracy`)."""
    names = objective_own_names()
    assert {"reward", "reward_margin", "pref_accuracy", "kl"} <= names and "loss" not in names
    # positive controls: the reads the display once made are seen
    for planted in ('if ev.extra.get("reward") is not None:', "if ev.reward_margin is not None and ev.pref_accuracy:",
                    "self.val_pref_accs.append(float(ev.pref_accuracy))", "parts = ev.extra['kl']"):
        assert field_reads(planted, names), planted
    for fine in ("for m in self.metrics[0]:", "rewards = self.query_one(MetricsChart)", "m.value(ev)"):
        assert not field_reads(fine, names), fine
    found = {rel: hits for rel in DISPLAY
             if (hits := field_reads(open(os.path.join(REPO, rel), encoding="utf-8").read(), names))}
    assert not found, f"display code reading an objective's own fields: {found}"


# ------------------------------------------------------------------ advantages and the loss vs torch


def numpy_advantages(rewards: np.ndarray, G: int, scale: str) -> np.ndarray:
    """TRL's recipe, written out: reward - group mean, over (unbiased std + 1e-4)."""
    out = np.zeros_like(rewards)
    all_std = np.std(rewards, ddof=1)
    for g in range(len(rewards) // G):
        r = rewards[g * G:(g + 1) * G]
        std = np.std(r, ddof=1)
        a = r - r.mean() if std > 1e-12 else np.zeros(G)
        out[g * G:(g + 1) * G] = a / (std + 1e-4) if scale == "group" else a / (all_std + 1e-4) if scale == "batch" else a
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_the_formula(scale):
    rng = np.random.default_rng(0)
    rewards = np.concatenate([rng.normal(size=4), np.full(4, 0.7), rng.integers(0, 2, 4).astype(float)])
    adv, std = group_advantages(rewards, 4, scale)
    np.testing.assert_allclose(adv, numpy_advantages(rewards, 4, scale), rtol=1e-6, atol=1e-7)
    assert (adv[4:8] == 0).all()  # a constant group: exactly zero, whatever the scaling
    np.testing.assert_allclose(std[:4], np.std(rewards[:4], ddof=1))


def torch_loss(logp, old, ref, adv, mask, loss_type, importance, eps, eps_high, beta, max_len, detached):
    """TRL's GRPOTrainer loss from its documentation, in float64."""
    old = logp.detach() if detached else old
    log_ratio = logp - old
    if importance == "sequence":
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_w = log_ratio
    c1 = torch.exp(log_w)
    c2 = torch.clamp(c1, 1 - eps, 1 + eps_high)
    per_token = -torch.min(c1 * adv[:, None], c2 * adv[:, None])
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    if beta:
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type in ("bnpo", "dapo"):  # one micro-batch, one process: the same normaliser
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        loss = (per_token * mask).sum() / (per_token.size(0) * max_len)
    low = ((c1 < 1 - eps) & (adv[:, None] < 0)).double()
    high = ((c1 > 1 + eps_high) & (adv[:, None] > 0)).double()
    region = torch.maximum(low, high)
    clip = region.mean() if importance == "sequence" else (region * mask).sum() / mask.sum()
    return loss, (kl * mask).sum() / mask.sum(), clip


def loss_inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    B, T = 6, 9
    mask = np.zeros((B, T), np.float32)
    for b, n in enumerate([9, 4, 7, 1, 6, 8]):
        mask[b, T - n:] = 1  # completions after prompts of different lengths
    logp = (-rng.uniform(0.05, 3.0, (B, T))).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32)  # ratios both sides of the clip
    ref = (logp + rng.normal(0, 0.5, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1, B).astype(np.float32)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("beta,detached", [(0.0, False), (0.04, False), (0.04, True)])
def test_loss_and_gradients_equal_torch(loss_type, importance, beta, detached):
    logp, old, ref, adv, mask = loss_inputs()
    spec = GRPOSpec(loss_type, importance, 0.2, 0.28, beta, max_completion_tokens=12, detached_old=detached)
    norms = mx.array([mask.shape[0], float(mask.sum()), float(mask.sum())], dtype=mx.float32)

    def f(lp):
        return grpo_loss(lp, mx.array(old), mx.array(ref), mx.array(adv), mx.array(mask), spec, norms)

    loss, stats = f(mx.array(logp))
    grad = mx.grad(lambda lp: f(lp)[0])(mx.array(logp))
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in dict(logp=logp, old=old, ref=ref, adv=adv, mask=mask).items()}
    t["logp"].requires_grad_(True)
    t_loss, t_kl, t_clip = torch_loss(t["logp"], t["old"], t["ref"], t["adv"], t["mask"], loss_type, importance,
                                      0.2, 0.28, beta, 12, detached)
    t_loss.backward()
    assert loss.item() == pytest.approx(t_loss.item(), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(np.array(grad), t["logp"].grad.numpy(), rtol=1e-4, atol=1e-6)
    kl, clip = np.array(stats)[1], np.array(stats)[4]
    if beta:
        assert kl == pytest.approx(t_kl.item(), rel=1e-5)
    assert clip == pytest.approx(t_clip.item(), abs=1e-6)
    if not detached:
        assert clip > 0  # the fixture does reach the clip


def test_micro_batches_add_up_to_the_step():
    """Split into two micro-batches with the step's norms, the losses and gradients sum to the
    one-batch ones (grpo, dr_grpo, dapo); bnpo is each micro-batch's token mean, averaged."""
    logp, old, ref, adv, mask = loss_inputs(1)
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo"):
        spec = GRPOSpec(loss_type, "token", 0.2, 0.2, 0.04, 12, detached_old=False)
        parts = [slice(0, 2), slice(2, 6)]

        def loss_of(lp, rows, norms):
            return grpo_loss(lp, mx.array(old[rows]), mx.array(ref[rows]), mx.array(adv[rows]),
                             mx.array(mask[rows]), spec, norms)[0]

        split = 0.0
        for rows in parts:
            micro = mx.array([6, float(mask.sum()), float(mask[rows].sum()) * 2], dtype=mx.float32)
            split += loss_of(mx.array(logp[rows]), rows, micro).item()
        if loss_type == "bnpo":
            whole = np.mean([loss_of(mx.array(logp[r]), r, mx.array([6, float(mask.sum()), float(mask[r].sum())])).item()
                             for r in parts])
        else:
            whole = loss_of(mx.array(logp), slice(0, 6), mx.array([6, float(mask.sum()), float(mask.sum())])).item()
        assert split == pytest.approx(whole, rel=1e-5, abs=1e-7), loss_type


def test_kl_gradient_is_zero_at_ratio_one():
    logp, _, _, _, mask = loss_inputs(2)
    spec = GRPOSpec("dapo", "token", 0.2, 0.2, beta=0.5, detached_old=True)
    norms = mx.array([mask.shape[0], float(mask.sum()), float(mask.sum())], dtype=mx.float32)
    zero_adv = mx.zeros((mask.shape[0],))
    grad = mx.grad(lambda lp: grpo_loss(lp, mx.array(logp), mx.array(logp), zero_adv, mx.array(mask), spec, norms)[0])(
        mx.array(logp))
    assert not np.array(grad).any()
    # positive control: away from the reference the KL pulls back
    grad = mx.grad(lambda lp: grpo_loss(lp, mx.array(logp), mx.array(logp - 0.3), zero_adv, mx.array(mask), spec,
                                        norms)[0])(mx.array(logp))
    assert np.abs(np.array(grad)).max() > 1e-3


def test_stored_logps_equal_the_training_forward():
    """The generating policy's log-probs, stored right after generation, are the training
    forward's to the bit: the ratio at the first iteration is exactly 1."""
    model = tiny_model(0, vocab_size=259)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 259, (4, 25)).astype(np.int32)
    pos = np.array([[10 + j + b for j in range(8)] for b in range(4)], dtype=np.int32)  # completion positions
    targets = np.take_along_axis(x[:, 1:], pos, 1)
    args = mx.array(x[:, :-1]), mx.array(pos), mx.array(targets)
    stored = completion_logps(model, *args, train=False, entropy=False)[0]
    train_logp, entropy = completion_logps(model, *args)
    assert np.array_equal(np.array(stored), np.array(train_logp))
    assert not np.array(train_logp - mx.stop_gradient(stored)).any()  # log-ratio 0: ratio exp(0) = 1
    np.testing.assert_array_equal(np.take_along_axis(np.array(-token_losses(model, args[0], mx.array(x[:, 1:]))), pos, 1),
                                  np.array(train_logp))  # the same as every position's, read at the completion
    # and against torch's log-softmax / entropy of the full logits (at the sampling temperature)
    for temp in (1.0, 0.7):
        logp, entropy = completion_logps(model, *args, temperature=temp)
        logits = torch.tensor(np.array(model(args[0])), dtype=torch.float64) / temp
        lsm = torch.log_softmax(logits, -1).gather(1, torch.tensor(pos.astype(np.int64))[..., None].expand(-1, -1, 259))
        want = lsm.gather(-1, torch.tensor(targets[..., None].astype(np.int64)))[..., 0]
        np.testing.assert_allclose(np.array(logp), want.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(entropy), -(lsm.exp() * lsm).sum(-1).numpy(), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ rewards


class Row:
    def __init__(self, answer, row=None, where="t:1"):
        self.answer, self.row, self.where = answer, row or {"prompt": "q", "answer": answer}, where
        self.prompt = self.row.get("prompt")


def test_builtin_rewards():
    assert split_specs("exact,regex:a{1,2},b,length:4") == ["exact", "regex:a{1,2},b", "length:4"]
    rs = RewardSet.parse("exact,contains,regex:^\\d+$,numeric,think-format,length:4")
    rows = [Row("42"), Row("42"), Row("42"), Row("no number")]
    texts = [" 42 ", "it is 42.", "<think>6*7</think> 42", "x"]
    got = rs.score(rows, texts, [2, 5, 9, 1])
    want = np.array([[1, 1, 0, 1, 0, 0], [0, 1, 0, 1, 0, -0.25], [0, 1, 0, 1, 1, -1.25],
                     [0, 0, 0, np.nan, 0, 0]])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want))
    weighted = RewardSet.parse("exact,numeric", [2.0, 0.5])
    np.testing.assert_allclose(weighted.combine(weighted.score(rows[3:], ["x"], [1])), [0.0])  # None counts 0
    for bad, msg in (("nope", "unknown reward"), ("regex:(", "not a valid regular expression"),
                     ("length:0", "N must be"), ("", "needs --reward")):
        with pytest.raises(UserError, match=re.escape(msg)):
            RewardSet.parse(bad)
    with pytest.raises(UserError, match="2 weights for 1 rewards"):
        RewardSet.parse("exact", [1.0, 2.0])


def test_user_reward_gets_the_columns_it_names(tmp_path):
    path = tmp_path / "rw.py"
    path.write_text("calls = []\n"
                    "def score(completion, answer, level, **rest):\n"
                    "    calls.append(sorted(rest))\n"
                    "    return None if level < 0 else float(completion == answer) + level\n"
                    "def narrow(completion):\n    return len(completion)\n")
    rs = RewardSet.parse(f"{path}:score,{path}:narrow")
    got = rs.score([Row("a", {"prompt": "p", "answer": "a", "level": 2}),
                    Row("a", {"prompt": "p", "answer": "a", "level": -1})], ["a", "bb"], [1, 2])
    np.testing.assert_allclose(got, [[3.0, 1.0], [np.nan, 2.0]])
    assert rs.names == ["score", "narrow"]
    with pytest.raises(UserError, match="needs column 'level', which t:1 does not have"):
        rs.score([Row("a")], ["a"], [1])


# ------------------------------------------------------------------ generation


def test_batched_generation_equals_one_prompt_at_a_time():
    model = tiny_model(0, vocab_size=259)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(40, 52))]
    greedy = SamplingParams(temp=0.0)
    out = generate_batch(model, prompts, repeats=2, sampling=greedy, max_tokens=10, eos_ids=[258], seed=0)
    for i, row in enumerate(out):
        alone = [t for t, _ in generate_tokens(model, prompts[i // 2], sampling=greedy, max_tokens=10)]
        assert row == alone, i
    hot = SamplingParams(temp=1.0)
    a = generate_batch(model, prompts, repeats=3, sampling=hot, max_tokens=8, eos_ids=[258], seed=7)
    assert a == generate_batch(model, prompts, repeats=3, sampling=hot, max_tokens=8, eos_ids=[258], seed=7)
    assert a != generate_batch(model, prompts, repeats=3, sampling=hot, max_tokens=8, eos_ids=[258], seed=8)
    assert len({tuple(r) for r in a[:3]}) > 1  # a group's completions differ


# ------------------------------------------------------------------ training runs on a tiny model


def grpo_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": f"{a}+1", "answer": str(a + 1), "level": a % 3}
            for a in (rng.randrange(10, 99) for _ in range(n))]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    model = write_tiny_model_folder(str(root / "model"))
    data = write_jsonl(str(root / "data.jsonl"), grpo_rows(40, 1))
    (root / "rw.py").write_text("def short(completion, level):\n    return -len(completion) / 8.0 + level\n"
                                "def constant(completion):\n    return 1.0\n")
    return {"root": root, "model": model, "data": data, "rw": str(root / "rw.py")}


def cfg_for(work, out, **kw) -> TrainConfig:
    base = dict(model=work["model"], data=work["data"], out=str(out), method="lora", objective="grpo",
                reward=f"exact,{work['rw']}:short", steps=4, batch_size=2, group_size=4, max_completion_tokens=10,
                seq_len=64, lr=5e-3, eval_every=2, eval_batches=1, save_every=0, lora_targets=["q", "v"], seed=0)
    base.update(kw)
    return TrainConfig(**base)


def events(run, kind: str) -> list[dict]:
    return [e for e in read_metrics(os.path.join(str(run), "metrics.jsonl")) if e["event"] == kind]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_resume_equals_uninterrupted(work, tmp_path, method):
    kw = dict(method=method, steps=4, grad_accum=2, beta=0.04, lr=1e-3 if method == "full" else 5e-3,
              loss_type="grpo", iterations_per_generation=1)
    full = run_training(cfg_for(work, tmp_path / "full", **kw), handle_sigint=False)
    part = run_training(cfg_for(work, tmp_path / "part", **kw), control=TrainControl(stop_at=2), handle_sigint=False)
    assert part.reason == "stopped" and part.step == 2
    rest = run_training(resume_config(str(tmp_path / "part"), {}), resume=True, handle_sigint=False)
    assert rest.reason == "finished" and rest.step == 4 and full.reason == "finished"
    a, b = events(tmp_path / "full", "step"), events(tmp_path / "part", "step")
    assert [e["samples"] for e in a] == [e["samples"] for e in b]  # the same completions sampled
    for key in ("loss", "reward", "kl", "entropy", "grad_norm"):
        np.testing.assert_allclose([e[key] for e in a], [e[key] for e in b], rtol=0, atol=1e-6, err_msg=key)
    assert any(e["kl"] > 0 for e in a[1:])  # the reference is in use
    for k, v in mx.load(str(tmp_path / "full" / "checkpoints" / "step_4" / "trainable.safetensors")).items():
        w = mx.load(str(tmp_path / "part" / "checkpoints" / "step_4" / "trainable.safetensors"))[k]
        np.testing.assert_allclose(np.array(v), np.array(w), rtol=0, atol=1e-6, err_msg=k)
    ev = events(tmp_path / "full", "eval")
    assert ev and all("reward" in e and e["val_loss"] == -e["reward"] for e in ev)
    step = a[0]
    for key in ("reward_std", "rewards/exact/mean", "rewards/short/mean", "frac_reward_zero_std",
                "completions/mean_length", "completions/clipped_ratio", "clip_ratio", "entropy"):
        assert key in step, key
    assert len(step["samples"]) == 4 and {"prompt", "completion", "reward", "rewards"} <= set(step["samples"][0])


def test_constant_reward_gives_zero_advantage_and_no_update(work, tmp_path):
    res = run_training(cfg_for(work, tmp_path / "run", reward=f"{work['rw']}:constant", steps=2, eval_every=0,
                               lora_targets=["q", "v", "down"]), handle_sigint=False)
    assert res.reason == "finished"
    steps = events(tmp_path / "run", "step")
    assert all(e["frac_reward_zero_std"] == 1.0 and e["reward_std"] == 0.0 and e["loss"] == 0.0 for e in steps)
    assert all(e["grad_norm"] == 0.0 for e in steps)
    trained = mx.load(str(tmp_path / "run" / "checkpoints" / "step_2" / "trainable.safetensors"))
    assert all(not np.array(v).any() for k, v in trained.items() if k.endswith(".b") or "lora_b" in k)
    # positive control: a reward that varies moves the adapters
    run_training(cfg_for(work, tmp_path / "moves", steps=2, eval_every=0), handle_sigint=False)
    moved = mx.load(str(tmp_path / "moves" / "checkpoints" / "step_2" / "trainable.safetensors"))
    assert any(np.array(v).any() for k, v in moved.items() if k.endswith(".b") or "lora_b" in k)


def _main(args):
    from mlxtoy.cli import main

    err, so = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(so):
        code = main(args)
    return code, err.getvalue().strip().splitlines()


def test_bad_input_one_error_line_exit_2(work, tmp_path):
    common = ["--model", work["model"], "--steps", "1"]
    sft = write_jsonl(str(tmp_path / "sft.jsonl"), [{"prompt": "a", "completion": "b"}])
    cases = [
        (["--data", work["data"], "--objective", "grpo"], "--objective grpo needs --reward"),
        (["--data", work["data"], "--objective", "grpo", "--reward", "exactly"], "--reward exactly: unknown reward"),
        (["--data", work["data"], "--objective", "grpo", "--reward", "nofile.py:f"], "no such file nofile.py"),
        (["--data", sft, "--objective", "grpo", "--reward", "exact"], "--objective grpo needs prompt rows"),
        (["--data", work["data"]], "prompt/answer rows need --objective grpo (the objective is sft)"),
        (["--data", work["data"], "--group-size", "4"], "group_size applies to objective grpo only"),
        (["--data", work["data"], "--objective", "grpo", "--reward", "exact", "--group-size", "1"],
         "group_size must be >= 2"),
        (["--data", work["data"], "--objective", "grpo", "--reward", "exact", "--loss-type", "x"],
         "loss_type must be one of"),
    ]
    for i, (extra, msg) in enumerate(cases):
        out = tmp_path / f"out{i}"
        code, lines = _main(["train", *common, "--out", str(out), *extra])
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], (msg, lines)
        assert not out.exists(), msg


def test_a_raising_reward_is_one_error_line_and_keeps_the_run(work, tmp_path):
    path = tmp_path / "boom.py"
    path.write_text("calls = [0]\n"
                    "def boom(completion, answer):\n"
                    "    calls[0] += 1\n"
                    "    if calls[0] > 9:  # the second step's first completion (call 1: the check before loading)\n"
                    "        raise ValueError('cannot parse\\nthis')\n"
                    "    return float(completion == answer)\n")
    out = tmp_path / "run"
    r = run_cli("train", "--model", work["model"], "--data", work["data"], "--out", str(out), "--objective", "grpo",
                "--reward", f"{path}:boom", "--steps", "3", "--batch-size", "2", "--group-size", "4",
                "--max-completion-tokens", "6", "--eval-every", "0", "--save-every", "0")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert lines[-1].startswith("error: ") and sum(m.startswith("error") for m in lines) == 1, lines
    assert f"{path}:boom: raised ValueError: cannot parse this (on {work['data']}:" in lines[-1], lines[-1]
    assert "Traceback" not in r.stderr
    # nothing lost: the step trained before the error is checkpointed, and the run resumes
    assert (out / "checkpoints" / "step_1").is_dir()
    assert not (out / ".lock").exists() and not any(n.endswith(".lock") for n in os.listdir(out))


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_two_ranks_equal_one_process(work, tmp_path, loss_type):
    """Each rank trains on its whole groups (batch-size counts prompts, a multiple of the
    ranks); the gradients add up to the one-process step's."""
    from test_distributed import AUDIT, assert_same_run, launch

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AUDIT)
    w = dict(work, site=str(site))
    args = ["--model", work["model"], "--data", work["data"], "--objective", "grpo", "--reward",
            f"exact,{work['rw']}:short", "--steps", "3", "--batch-size", "2", "--group-size", "4",
            "--max-completion-tokens", "8", "--seq-len", "64", "--eval-every", "3", "--eval-batches", "1",
            "--lr", "5e-3", "--beta", "0.04", "--loss-type", loss_type, "--grad-accum", "2", "--seed", "0"]
    one = str(tmp_path / "one")
    r = run_cli("train", *args, "--out", one)
    assert r.returncode == 0, r.stderr
    two = str(tmp_path / "two")
    r = launch(w, [*args, "--out", two], timeout=300)
    assert r.returncode == 0 and '"world_size": 2' in r.stdout, r.stdout + r.stderr
    assert_same_run(two, one)
    for key in ("reward", "kl", "entropy", "clip_ratio"):
        np.testing.assert_allclose([e[key] for e in events(two, "step")], [e[key] for e in events(one, "step")],
                                   atol=1e-5, rtol=0, err_msg=key)


# ------------------------------------------------------------------ the bundled example, SmolLM2

GRPO_ASSETS = os.path.join(REPO, "assets", "grpo")
HELD_OUT_MARGIN = 0.15  # the held-out mean greedy reward must rise by at least this


def held_out_reward(model, tokenizer, rows: list[dict]) -> float:
    """The example's reward (reward.py's date_parts + exact + length:8, written out here) of
    greedy answers to the test prompts, rendered as `mlxtoy generate --chat` renders them."""
    import importlib.util

    from mlxtoy.generate import encode_chat

    spec = importlib.util.spec_from_file_location("grpo_reward", os.path.join(GRPO_ASSETS, "reward.py"))
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    eos = set(tokenizer.eos_ids)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": r["prompt"]}]) for r in rows]
    outs = generate_batch(model, prompts, sampling=SamplingParams(temp=0.0), max_tokens=10, eos_ids=eos)
    total = 0.0
    for r, o in zip(rows, outs):
        text = tokenizer.decode([t for t in o if t not in eos])
        total += reward.date_parts(text, r["day"], r["month"], r["year"])
        total += float(text.strip() == r["answer"]) + (0.0 if len(o) <= 8 else -(len(o) - 8) / 8)
    return total / len(rows)


def test_smollm2_bundled_task_raises_held_out_reward(smollm2_path, tmp_path):
    import json
    import time

    from mlxtoy.loading import load

    rows = [json.loads(line) for line in open(os.path.join(GRPO_ASSETS, "test.jsonl"))][:24]
    base, tok = load(smollm2_path)
    before = held_out_reward(base, tok, rows)
    del base
    out = tmp_path / "run"
    t0 = time.perf_counter()
    r = run_cli("train", "--config", os.path.join(GRPO_ASSETS, "grpo.yaml"), "--model", smollm2_path,
                "--out", str(out), "--steps", "12", "--eval-every", "0", timeout=900)
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    tuned, tok = load(smollm2_path, adapter=str(out))
    after = held_out_reward(tuned, tok, rows)
    print(f"held-out greedy reward {before:.3f} -> {after:.3f} after 12 steps ({took:.0f} s of training)")
    assert after >= before + HELD_OUT_MARGIN, (before, after)


# ------------------------------------------------------------------ the TUI


def test_tui_reward_chart_and_samples_follow_a_grpo_run():
    """Events of a GRPO run arrive one by one: the dashboard's headline chart plots the reward
    (sampled, and held-out greedy points), the chart beside it GRPO's other declared values, and
    the samples panel (each completion with its rewards) follows them; an SFT run charts its
    loss and nothing beside it."""
    import asyncio

    from textual.widgets import RichLog

    from fake_trainer import fake_events
    from tui.app import MlxtoyApp
    from tui.state import RUNNING, RunState
    from tui.widgets import LossChart, MetricsChart

    async def drive():
        app = MlxtoyApp(model="tiny.gguf", data=None, runs_dir="runs")
        async with app.run_test(size=(140, 44)) as pilot:
            state = RunState()
            app.run_state = state
            await pilot.press("f2")
            chart, more = app.screen.query_one(LossChart), app.screen.query_one(MetricsChart)
            samples = app.screen.query_one("#samples", RichLog)
            seen = []
            for ev in fake_events(steps=12, n_layers=4, objective="grpo", done=False):
                state.apply(ev)
                state.status = RUNNING
                if ev["event"] in ("step", "eval") and ev["step"] in (3, 10):
                    await pilot.pause(1.2)  # the chart redraws at most once a second
                    seen.append((len(chart.steps), len(chart.val_steps), len(samples.lines)))
            rewards = state.headline_series[0].values
            assert chart.label == "reward" and chart.losses == rewards[:len(chart.losses)] and rewards[-1] > rewards[0]
            assert state.summary()["reward"] == f"{rewards[-1]:.3f}"
            assert seen[0][0] == 3 and seen[-1][0] == 10 and seen[-1][1] == 1, seen  # train line, a valid point
            assert seen[-1][2] > seen[0][2] > 0, seen  # the samples panel grew
            assert more.display and [label for label, _ in more._lines] == ["loss", "len"]
            text = "\n".join(str(line.text) for line in samples.lines)
            assert "26 December 2011 (step 10)" in text and "reward" in text and "exact" in text
            app.run_state = RunState.from_events(list(fake_events(steps=5, n_layers=4)))  # control: SFT
            app.screen.refresh_view(force=True)
            await pilot.pause(0.2)
            assert not app.screen.query_one(MetricsChart).display and app.screen.query_one(LossChart).label == "loss"

    asyncio.run(drive())


def test_setup_preview_reads_prompt_rows(tmp_path):
    from helpers_train import byte_tokenizer
    from tui.setup import data_preview

    out = data_preview(os.path.join(GRPO_ASSETS, "train.jsonl"), "m", 64, {"m": byte_tokenizer(tmp_path)})
    assert out["kind"] == "prompt" and out["count"] == 200 and "answer" in out["examples"][0]
    assert out["tokenizer_error"] is None and out["lengths"]["n"] == 200 and out["lengths"]["min"] > 40


def test_resume_mid_generation_equals_uninterrupted(work, tmp_path):
    """--iterations-per-generation 2 with a checkpoint between the two steps on one
    generation: the checkpoint keeps the generation (and its stored log-probs)."""
    kw = dict(steps=4, iterations_per_generation=2, lr=5e-3, eval_every=0, epsilon=0.05)
    full = run_training(cfg_for(work, tmp_path / "full", **kw), handle_sigint=False)
    part = run_training(cfg_for(work, tmp_path / "part", **kw), control=TrainControl(stop_at=1), handle_sigint=False)
    assert part.step == 1 and (tmp_path / "part" / "checkpoints" / "step_1" / "objective.safetensors").exists()
    rest = run_training(resume_config(str(tmp_path / "part"), {}), resume=True, handle_sigint=False)
    assert rest.step == 4 and full.reason == "finished"
    a, b = events(tmp_path / "full", "step"), events(tmp_path / "part", "step")
    assert a[0]["samples"] == a[1]["samples"] != a[2]["samples"]  # two steps on each generation
    assert any(e["clip_ratio"] > 0 for e in a)  # the second step's ratio moved off 1
    for key in ("loss", "reward", "clip_ratio", "grad_norm"):
        np.testing.assert_allclose([e[key] for e in a], [e[key] for e in b], rtol=0, atol=1e-6, err_msg=key)


# ------------------------------------------------------------------ dynamic sampling and the other options


def fake_rollout(pos: int, group_size: int = 2) -> "object":
    """Two prompts' groups at data position `pos`: the first one's rewards all equal when pos is
    even, the second's always differing."""
    from mlxtoy.train.grpo import Prompt, Rollout, completion_batch

    prompts = [Prompt(np.array([1, 2, 3], np.int32), str(pos), {"prompt": f"p{pos}.{i}"}, f"t:{pos}") for i in range(2)]
    completions = [[4 + k, 5] for k in range(2 * group_size)]
    rewards = np.array([1.0, 1.0, float(pos), pos + 1.0]) if pos % 2 == 0 else np.array([0.0, 1.0, 2.0, 0.0])
    adv, std = group_advantages(rewards, group_size, "group")
    batch = completion_batch(prompts, completions, group_size, 0, pos, 4)
    batch.advantages = adv
    return Rollout(batch, rewards, rewards[:, None], std, np.full(4, 2), np.zeros(4, bool),
                   [f"c{pos}.{k}" for k in range(4)], [prompts[k // group_size] for k in range(4)])


def test_skip_zero_std_groups_drops_and_refills():
    from mlxtoy.train.grpo import collect

    got = collect(lambda positions: fake_rollout(*positions), 10, micro_batches=1, batch_size=2, group_size=2,
                  skip_zero_std=True, max_draws=4)
    (roll,) = got.rolls
    assert got.positions == 2 and len(got.seen) == 2  # position 10's first group was refilled from 11
    assert roll.texts == ["c10.2", "c10.3", "c11.0", "c11.1"]
    assert (roll.std > 0).all() and roll.batch.inputs.shape[0] == 4 and roll.batch.positions.shape == (4, 4)
    plain = collect(lambda positions: fake_rollout(*positions), 10, 1, 2, 2, skip_zero_std=False, max_draws=4)
    assert plain.positions == 1 and plain.rolls[0].texts[:2] == ["c10.0", "c10.1"]  # control: kept
    calls = []

    def draw(positions):  # two micro-batches' prompts: one generation
        calls.append(positions)
        one = fake_rollout(positions[0])
        return merge(one, fake_rollout(positions[1]), 8) if len(positions) == 2 else one

    from mlxtoy.train.grpo import merge

    two = collect(draw, 10, 2, 2, 2, skip_zero_std=False, max_draws=4)
    assert calls == [[10, 11]] and two.positions == 2 and [r.batch.index for r in two.rolls] == [10, 11]
    assert two.rolls[1].texts == ["c11.0", "c11.1", "c11.2", "c11.3"]


def test_every_option_trains(work, tmp_path):
    """Full fine-tuning with a reference, GSPO's sequence ratio, dr_grpo, batch-scaled rewards,
    two iterations a generation and dynamic sampling, through the CLI."""
    out = tmp_path / "run"
    r = run_cli("train", "--model", work["model"], "--data", work["data"], "--out", str(out), "--method", "full",
                "--objective", "grpo", "--reward", f"{work['rw']}:short,exact", "--reward-weights", "1,2",
                "--steps", "4", "--batch-size", "2", "--group-size", "3", "--max-completion-tokens", "6",
                "--beta", "0.1", "--importance-sampling", "sequence", "--loss-type", "dr_grpo", "--scale-rewards",
                "batch", "--iterations-per-generation", "2", "--skip-zero-std-groups", "--epsilon-high", "0.28",
                "--temp", "0.9", "--top-p", "0.95", "--min-p", "0.05", "--lr", "1e-3", "--eval-every", "2")
    assert r.returncode == 0, r.stderr
    assert re.search(r"step \d+: val reward [-\d.]+", r.stderr) and re.search(r"step \d+/4 reward [-\d.]+, loss ", r.stderr)
    steps = events(out, "step")
    assert len(steps) == 4 and all(np.isfinite(e["loss"]) and e["kl"] >= 0 for e in steps)
    assert steps[0]["samples"] == steps[1]["samples"] and steps[1]["kl"] > 0


def test_table_columns_become_prompt_and_answer(tmp_path):
    """A CSV with its own column names: --prompt-column / --answer-column; the other columns
    stay on the row for the rewards."""
    from mlxtoy.train.records import DataOptions, read_data

    path = tmp_path / "qa.csv"
    path.write_text("question,solution,difficulty\nWhat is 6*7?,42,easy\nWhat is 2+2?,4,easy\n")
    cfg = TrainConfig(data=str(path), objective="grpo", prompt_column="question", answer_column="solution")
    raw = read_data(str(path), DataOptions.of(cfg))
    rec = raw.train[0]
    assert rec.kind == "prompt" and rec.value[0] == [{"role": "user", "content": "What is 6*7?"}]
    assert str(rec.value[1]) == "42" and rec.value[2]["difficulty"] == "easy"
    rewards = RewardSet.parse("numeric")
    prompts = [type("P", (), {"answer": rec.value[1], "row": rec.value[2], "where": rec.where, "prompt": "q"})()]
    assert rewards.score(prompts, ["The answer is 42."], [5])[0, 0] == 1.0
    with pytest.raises(UserError, match="no column 'answer_text'"):
        read_data(str(path), DataOptions.of(TrainConfig(data=str(path), objective="grpo",
                                                        answer_column="answer_text")))


def test_dashboards_get_the_same_values():
    from mlxtoy.dashboards import scalars
    from mlxtoy.events import EvalEvent, StepEvent

    step = StepEvent.of({"reward": 0.5, "rewards/exact/mean": 0.25, "kl": 0.01, "samples": [{"completion": "x"}]},
                        step=3, loss=0.1, lr=1e-3, tokens=10, tokens_per_sec=5.0, elapsed=1.0, eta=2.0,
                        peak_memory_gb=0.1)
    got = scalars(step)
    assert got["train/reward"] == 0.5 and got["train/rewards/exact/mean"] == 0.25 and got["train/kl"] == 0.01
    assert not any("samples" in k for k in got) and got["train/loss"] == pytest.approx(0.1)
    ev = EvalEvent.of({"reward": 0.7}, step=3, val_loss=-0.7, val_ppl=0.5, val_tokens=8)
    assert scalars(ev)["val/reward"] == 0.7
