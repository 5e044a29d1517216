"""GRPO as TRL >= 1.6 behaves, against a torch implementation of TRL's GRPOTrainer code written
here: unscorable completions (every reward None, or NaN) and their advantages, the step
metrics (reward_std over the batch, rewards/<name>/std, the terminated lengths, num_tokens,
clip_ratio/low_min and high_max), --mask-truncated-completions in the loss, the soft overlong
reward, the warning for sequence-level ratios with a length-weighted loss, top-k and the
repetition penalty in rollouts, and --eval-generations. Each rule has a control that fails
when the rule is reverted."""

from __future__ import annotations

import math
import os

import mlx.core as mx
import numpy as np
import pytest
import torch

from helpers_train import run_training, tiny_model, write_jsonl, write_tiny_model_folder
from mlxtoy.config import TrainConfig
from mlxtoy.engine import generate_batch
from mlxtoy.errors import UserError
from mlxtoy.rundir import read_metrics
from mlxtoy.sampling import SamplingParams
from mlxtoy.train import grpo
from mlxtoy.train.grpo import GRPOSpec, group_advantages, grpo_loss
from mlxtoy.train.objectives import GRPO
from mlxtoy.train.rewards import RewardSet

# ------------------------------------------------------------------ TRL's code, in torch


def t_nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
    """trl.trainer.utils.nanstd."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    corr = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var * corr)
    return std.squeeze() if dim is None else std.squeeze(dim)


def trl_score(per_func: np.ndarray, weights: np.ndarray, G: int, scale: str) -> tuple[np.ndarray, dict]:
    """GRPOTrainer._generate_and_score_completions (sum_then_normalize): advantages and the
    reward metrics, from the rewards per function (NaN: the function said None)."""
    rpf = torch.tensor(per_func, dtype=torch.float64)
    w = torch.tensor(weights, dtype=torch.float64)
    unscorable = torch.isnan(rpf).all(dim=1)
    rewards = (rpf * w.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean_g = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    if scale in ("group", "none"):
        std = t_nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
    else:
        std = t_nanstd(rewards).expand_as(rewards)
    adv = rewards - mean_g
    if scale != "none":
        adv = adv / (std + 1e-4)
    adv = torch.nan_to_num(adv, nan=0.0)
    metrics = {}
    for i in range(rpf.shape[1]):
        metrics[f"rewards/f{i}/mean"] = torch.nanmean(rpf[:, i]).item()
        metrics[f"rewards/f{i}/std"] = t_nanstd(rpf[:, i]).item()
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = t_nanstd(rewards).item()
    return adv.numpy(), metrics


def trl_lengths(lengths: np.ndarray, truncated: np.ndarray) -> dict:
    """The completion-length metrics (TRL's _generate)."""
    agg = torch.tensor(lengths, dtype=torch.float64)
    trunc = torch.tensor(truncated)
    out = {"completions/mean_length": agg.mean().item(), "completions/min_length": agg.min().item(),
           "completions/max_length": agg.max().item(), "completions/clipped_ratio": trunc.double().mean().item()}
    term = agg[~trunc]
    if len(term) == 0:
        term = torch.zeros(1)
    out["completions/mean_terminated_length"] = term.mean().item()
    out["completions/min_terminated_length"] = term.min().item()
    out["completions/max_terminated_length"] = term.max().item()
    return out


def trl_loss(logp, old, adv, mask, truncated, loss_type, importance, eps, eps_high, max_len, mask_truncated):
    """GRPOTrainer._compute_loss (beta 0) with mask_truncated_completions, and its clip metrics."""
    if mask_truncated:
        mask = mask * (~truncated).unsqueeze(1).double()
    log_ratio = logp - old
    if importance == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    c1 = torch.exp(log_w)
    c2 = torch.clamp(c1, 1 - eps, 1 + eps_high)
    a = adv.unsqueeze(1)
    per_token = -torch.min(c1 * a, c2 * a)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type in ("bnpo", "dapo"):
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        loss = (per_token * mask).sum() / (per_token.size(0) * max_len)

    def masked_seq_mean(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    def nanmin(x):
        return torch.min(x[~torch.isnan(x)])

    def nanmax(x):
        return torch.max(x[~torch.isnan(x)])

    low = ((c1 < 1 - eps) & (a < 0)).double()
    high = ((c1 > 1 + eps_high) & (a > 0)).double()
    return loss, nanmin(masked_seq_mean(low)).item(), nanmax(masked_seq_mean(high)).item()


def trl_soft_overlong(max_len: int, cache: int, length: int) -> float:
    """trl.rewards.get_soft_overlong_punishment, for one completion's token count."""
    if length <= max_len - cache:
        return 0.0
    if max_len - cache < length <= max_len:
        return (max_len - cache - length) / cache
    return -1.0


# ------------------------------------------------------------------ fixtures


def rewards_with_gaps(seed: int = 0) -> np.ndarray:
    """(16, 2) rewards of 4 groups of 4: NaN where a function said None; row 1 and row 6
    unscorable (both None), group 3 has one scorable row only, group 2 is all equal."""
    rng = np.random.default_rng(seed)
    r = rng.normal(size=(16, 2)).round(2)
    r[[1, 6], :] = np.nan
    r[[3, 9, 14], 0] = np.nan  # one function said None: the other still scores the row
    r[8:12, :] = [[0.5, 1.0]] * 4
    r[12:16, :] = np.nan
    r[13] = [1.0, 2.0]
    return r


def reward_set(weights=(1.0, 0.5)) -> RewardSet:
    return RewardSet(["f0", "f1"], [lambda p, c, n: 0.0] * 2, np.asarray(weights))


def fake_rollout(per: np.ndarray, rs: RewardSet, G: int, scale: str, lengths, clipped) -> grpo.Rollout:
    combined = rs.combine(per)
    adv, std = group_advantages(combined, G, scale)
    prompts = [grpo.Prompt(np.arange(5 + i // G, dtype=np.int32), "a", {}, f"x:{i // G}") for i in range(len(per))]
    batch = grpo.completion_batch(prompts[::G], [[7] * int(n) for n in lengths], G, 0, 0, int(max(lengths)))
    batch.advantages = adv
    return grpo.Rollout(batch, combined, per, std, np.asarray(lengths), np.asarray(clipped),
                        ["t"] * len(per), prompts)


# ------------------------------------------------------------------ unscorable rows, advantages, metrics


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_and_reward_metrics_equal_trl(scale):
    per, rs = rewards_with_gaps(), reward_set()
    G = 4
    want_adv, want = trl_score(per, rs.weights, G, scale)
    adv, _ = group_advantages(rs.combine(per), G, scale)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-6)
    assert adv[1] == 0 and adv[6] == 0 and (adv[12:] == 0).all()  # unscorable / alone in its group
    lengths = np.array([3, 5, 8, 8, 2, 8, 4, 6, 8, 1, 7, 8, 5, 5, 3, 8])
    clipped = lengths == 8
    got = grpo.rollout_metrics([fake_rollout(per, rs, G, scale, lengths, clipped)], rs, G)
    for key, value in {**want, **trl_lengths(lengths, clipped)}.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert got["reward_std"] != pytest.approx(np.nanmean(np.repeat(grpo.nanstd(
        rs.combine(per).reshape(-1, G), axis=1), G)), abs=1e-3)  # not the mean of the groups' stds


def test_reverting_the_unscorable_rule_fails_the_check(monkeypatch):
    """Control: with the old rule (an all-None completion scores 0 and joins its group's
    baseline) the advantages no longer equal TRL's."""
    per, rs = rewards_with_gaps(), reward_set()
    want_adv, _ = trl_score(per, rs.weights, 4, "group")
    monkeypatch.setattr(RewardSet, "combine", lambda self, p: np.nansum(p * self.weights[None, :], axis=1))
    adv, _ = group_advantages(rs.combine(per), 4, "group")
    assert not np.allclose(adv, want_adv, rtol=1e-5, atol=1e-6)


def test_no_terminated_completion_gives_trl_zeros():
    per, rs = rewards_with_gaps(), reward_set()
    lengths = np.full(16, 8)
    got = grpo.rollout_metrics([fake_rollout(per, rs, 4, "group", lengths, np.ones(16, bool))], rs, 4)
    for key, value in trl_lengths(lengths, np.ones(16, bool)).items():
        assert got[key] == value, key


def test_nan_and_none_from_a_users_function(tmp_path):
    """np.float32('nan') is taken as None (TRL's NaN), where it used to stop the run; a row whose
    every reward is None or NaN is unscorable (NaN combined); inf is still an error."""
    f = tmp_path / "rw.py"
    f.write_text("import numpy as np\n"
                 "def nan32(completion):\n    return np.float32('nan') if completion == 'a' else np.float32(0.5)\n"
                 "def none(completion):\n    return None if completion in ('a', 'b') else 1\n"
                 "def inf(completion):\n    return float('inf')\n")
    rs = RewardSet.parse(f"{f}:nan32,{f}:none")
    p = grpo.Prompt(np.zeros(1, np.int32), "x", {}, "data.jsonl:4")
    per = rs.score([p] * 3, ["a", "b", "c"], [1, 1, 1])
    assert np.isnan(per[0]).all() and np.isnan(per[1, 1]) and per[1, 0] == 0.5
    combined = rs.combine(per)
    assert np.isnan(combined[0]) and combined[1] == 0.5 and combined[2] == 1.5
    with pytest.raises(UserError, match=r"inf.*returned inf on data.jsonl:4"):
        RewardSet.parse(f"{f}:inf").score([p], ["a"], [1])


# ------------------------------------------------------------------ the loss: truncated completions, clip extremes


def norms_of(mask: np.ndarray) -> mx.array:
    """`grpo_loss`'s norms for one micro-batch that is the whole step."""
    return mx.array([mask.shape[0], max(1.0, float(mask.sum())), max(1.0, float(mask.sum())), 1.0], dtype=mx.float32)


def loss_case(seed: int = 3):
    rng = np.random.default_rng(seed)
    B, T = 6, 7
    lengths = [7, 3, 7, 5, 1, 6]
    mask = np.zeros((B, T), np.float32)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    logp = (-rng.uniform(0.05, 3.0, (B, T))).astype(np.float32)
    old = (logp + rng.normal(0, 0.35, (B, T))).astype(np.float32)
    adv = np.array([1.2, -0.7, -1.1, 0.4, 0.9, -0.3], np.float32)
    truncated = np.array([n == T for n in lengths])
    return logp, old, adv, mask, truncated


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("mask_truncated", [False, True])
def test_loss_and_clip_extremes_equal_trl(loss_type, importance, mask_truncated):
    logp, old, adv, mask, truncated = loss_case()
    ours_mask = mask * ~truncated[:, None] if mask_truncated else mask  # what completion_batch leaves
    spec = GRPOSpec(loss_type, importance, 0.2, 0.28, 0.0, max_completion_tokens=7, detached_old=False)
    norms = norms_of(ours_mask)
    loss, stats = grpo_loss(mx.array(logp), mx.array(old), mx.array(old), mx.array(adv), mx.array(ours_mask), spec, norms)
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in dict(logp=logp, old=old, adv=adv, mask=mask).items()}
    want, low_min, high_max = trl_loss(t["logp"], t["old"], t["adv"], t["mask"], torch.tensor(truncated), loss_type,
                                       importance, 0.2, 0.28, 7, mask_truncated)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    got = dict(zip(grpo.STATS[1:], np.array(stats)[1:]))
    assert got["clip_ratio/low_min"] == pytest.approx(low_min, abs=1e-6)
    assert got["clip_ratio/high_max"] == pytest.approx(high_max, abs=1e-6)
    if importance == "token":
        assert high_max > 0 and high_max > got["clip_ratio/high_mean"]  # the case reaches the clip


def test_reverting_mask_truncated_fails_the_check():
    """Control: training on the truncated completions gives another loss than TRL's with
    mask_truncated_completions."""
    logp, old, adv, mask, truncated = loss_case()
    spec = GRPOSpec("dapo", "token", 0.2, 0.28, 0.0, max_completion_tokens=7, detached_old=False)
    loss, _ = grpo_loss(mx.array(logp), mx.array(old), mx.array(old), mx.array(adv), mx.array(mask), spec,
                        norms_of(mask))
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in dict(logp=logp, old=old, adv=adv, mask=mask).items()}
    want = trl_loss(t["logp"], t["old"], t["adv"], t["mask"], torch.tensor(truncated), "dapo", "token", 0.2, 0.28, 7,
                    True)[0]
    assert loss.item() != pytest.approx(want.item(), rel=1e-3)


def test_truncated_rows_train_nothing_in_the_batch():
    prompts = [grpo.Prompt(np.arange(4, dtype=np.int32), "a", {}, "x:1")]
    comps = [[5, 6, 258], [5, 6, 7, 8], [9, 258]]
    left_out = np.array([False, True, False])
    b = grpo.completion_batch(prompts, comps, 3, 0, 0, 4, left_out)
    assert b.weights[1].sum() == 0 and (b.positions[1] == -1).all() and b.n_loss == 3 + 2
    assert b.inputs.shape[0] == 3  # the row stays: its sequence counts, as in TRL


# ------------------------------------------------------------------ the soft overlong reward


def test_soft_overlong_equals_trl():
    rs = RewardSet.parse("exact,overlong:16,4,regex:a,b")
    assert rs.names == ["exact", "soft_overlong_punishment_reward", "regex"]
    p = grpo.Prompt(np.zeros(1, np.int32), "x", {}, "x:1")
    lengths = list(range(0, 22))
    per = rs.score([p] * len(lengths), ["y"] * len(lengths), lengths)
    assert per[:, 1].tolist() == [trl_soft_overlong(16, 4, n) for n in lengths]
    assert per[13, 1] == -0.25 and per[16, 1] == -1.0 and per[17, 1] == -1.0
    for bad in ("overlong:4,16", "overlong:x,2", "overlong:16"):
        with pytest.raises(UserError, match="want MAX,CACHE"):
            RewardSet.parse(bad)


# ------------------------------------------------------------------ the warning, sampling, num_tokens, eval


def test_warning_for_sequence_ratios_with_a_length_weighted_loss(tmp_path):
    from mlxtoy.train.data import DataStats, Dataset

    def warnings(**kw):
        cfg = TrainConfig(objective="grpo", reward="exact", importance_sampling="sequence", **kw).validate()
        return GRPO(cfg).data_warnings(Dataset([], [], [], [], DataStats(), DataStats()))

    for loss_type in ("bnpo", "dr_grpo", "dapo"):
        assert any("weights each sequence by its completion length" in w for w in warnings(loss_type=loss_type))
    assert warnings(loss_type="grpo") == []


def test_top_k_and_repetition_penalty_reach_the_rollouts():
    """The run's sampling carries them (the penalty over the whole prompt and completion), and
    the batched decoder obeys: top-k 1 samples the greedy completion at any temperature, and a
    strong penalty never repeats a token within a completion."""
    cfg = TrainConfig(objective="grpo", reward="exact", top_k=1, repetition_penalty=50.0, seq_len=64,
                      max_completion_tokens=10).validate()
    s = GRPO(cfg).sampling
    assert (s.top_k, s.repetition_penalty, s.repetition_window) == (1, 50.0, 74)
    model = tiny_model(0, vocab_size=259)
    prompts = [[5, 6, 7], [40, 41]]
    greedy = generate_batch(model, prompts, repeats=3, sampling=SamplingParams(temp=0.0), max_tokens=8)
    top1 = generate_batch(model, prompts, repeats=3, sampling=SamplingParams(temp=2.0, top_k=1), max_tokens=8, seed=3)
    assert top1 == greedy
    hot = generate_batch(model, prompts, repeats=3, sampling=SamplingParams(temp=2.0), max_tokens=8, seed=3)
    assert hot != greedy  # control: without top-k the draws differ
    penalized = generate_batch(model, prompts, repeats=3, sampling=s, max_tokens=8, seed=3)
    for i, row in enumerate(penalized):
        assert len(set(row)) == len(row) and not set(row) & set(prompts[i // 3]), row


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_trl")
    rows = [{"prompt": f"{a}+1", "answer": str(a + 1)} for a in range(20, 44)]
    (root / "rw.py").write_text("def some_none(completion):\n    return None if len(completion) % 3 else 1.0\n")
    return {"model": write_tiny_model_folder(str(root / "model")), "data": write_jsonl(str(root / "d.jsonl"), rows),
            "rw": str(root / "rw.py")}


def grpo_cfg(work, out, **kw) -> TrainConfig:
    base = dict(model=work["model"], data=work["data"], out=str(out), method="lora", objective="grpo",
                reward=f"{work['rw']}:some_none,overlong:8,4", steps=3, batch_size=2, group_size=3,
                max_completion_tokens=8, seq_len=64, lr=5e-3, eval_every=3, eval_batches=1, save_every=2,
                lora_targets=["q", "v"], seed=0, temp=1.5)
    base.update(kw)
    return TrainConfig(**base)


def test_a_run_reports_the_metrics_and_num_tokens_goes_on_after_resume(work, tmp_path):
    from mlxtoy.train.control import TrainControl
    from mlxtoy.train.job import resume_config

    full = run_training(grpo_cfg(work, tmp_path / "full", mask_truncated_completions=True, eval_generations=2),
                        handle_sigint=False)
    assert full.reason == "finished"
    steps = [e for e in read_metrics(os.path.join(tmp_path / "full", "metrics.jsonl")) if e["event"] == "step"]
    for key in ("rewards/some_none/std", "rewards/soft_overlong_punishment_reward/mean", "num_tokens",
                "completions/mean_terminated_length", "clip_ratio/low_min", "clip_ratio/high_max"):
        assert key in steps[0], key
    # num_tokens: every prompt and completion token sampled so far (6 completions a step)
    assert 0 < steps[0]["num_tokens"] < steps[1]["num_tokens"] < steps[2]["num_tokens"]
    ev = [e for e in read_metrics(os.path.join(tmp_path / "full", "metrics.jsonl")) if e["event"] == "eval"]
    assert all("sampled/reward" in e and "reward" in e for e in ev)  # the sampled eval beside the greedy one
    part = run_training(grpo_cfg(work, tmp_path / "part", mask_truncated_completions=True, eval_generations=2),
                        control=TrainControl(stop_at=2), handle_sigint=False)
    assert part.step == 2
    rest = run_training(resume_config(str(tmp_path / "part"), {}), resume=True, handle_sigint=False)
    assert rest.step == 3
    resumed = [e for e in read_metrics(os.path.join(tmp_path / "part", "metrics.jsonl")) if e["event"] == "step"]
    assert [e["num_tokens"] for e in resumed] == [e["num_tokens"] for e in steps]
    assert not any(isinstance(v, float) and math.isnan(v) for e in steps for v in e.values())


def test_the_objective_is_built_once_per_run(work, tmp_path, monkeypatch):
    """The job builds the run's objective once and hands it to the memory estimate (with its
    batch-size bisection), the loop and the step; validation resolved beta before it."""
    from mlxtoy.train import memory
    from mlxtoy.train.job import run_job

    built = []
    real_init = GRPO.__init__

    def counting_init(self, cfg):
        built.append(cfg.beta)
        real_init(self, cfg)

    monkeypatch.setattr(GRPO, "__init__", counting_init)
    # the step "does not fit": the suggestions (a batch-size bisection) are estimated too
    monkeypatch.setattr(memory.MemoryCheck, "fits", property(lambda self: False))
    res = run_job(lambda: (grpo_cfg(work, tmp_path / "run", epochs=1, eval_every=0), False), handle_sigint=False)
    assert res.exit_code == 0
    assert built == [0.0]  # once, with beta already resolved (grpo's default: no KL)
    # control: an estimate not handed the run's objective builds one, and the count sees it
    memory.estimate(grpo_cfg(work, tmp_path / "x").validate(), tiny_model(0))
    assert len(built) == 2
