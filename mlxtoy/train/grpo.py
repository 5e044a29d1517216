"""GRPO (Shao et al. 2024) and its 2025 variants: prompts, rollouts, advantages and the loss.

A step samples `group_size` completions of each of its prompts with the policy as it is
(`rollout`: every completion of the step, all its micro-batches, is one batch through the
batched decoder, mlxtoy.engine.generate_batch: each prompt prefilled once for its group),
scores them (mlxtoy.train.rewards), and trains on

    A_i = r_i - mean(r of its group)       divided by the group's std (--scale-rewards group),
                                           the batch's (batch) or nothing (none, Dr. GRPO);
    w_it = pi(o_it) / pi_old(o_it)         per token, or GSPO's per sequence
                                           exp(mean_t log(pi / pi_old)) (--importance-sampling);
    l_it = -min(w_it A_i, clip(w_it, 1 - eps, 1 + eps_high) A_i) + beta * KL_it,
    KL_it = exp(ref - logp) - (ref - logp) - 1                        (the k3 estimator),

aggregated by --loss-type (as TRL does):
    grpo     mean over sequences of each sequence's token mean,
    bnpo     each micro-batch's token mean, averaged over the micro-batches,
    dr_grpo  token sum / (sequences * max completion tokens),
    dapo     token sum / completion tokens of the whole step.
Log-probs are of the distribution sampled from (logits / --temp, as TRL's). The "old" policy
is the one that generated the completions: with one iteration per
generation its log-probs are the policy's own, detached (so w = 1 exactly); with more, the
log-probs computed right after generation (`Rollout.old`). Log-probs are over the prompt and
the sampled token ids, never re-tokenized text.

Like every objective here, each sum is divided by a count of the whole optimizer step
(`norms`), so micro-batches add up to the one-batch result. This module holds the math and
the rollout; mlxtoy.train.objectives.GRPO plugs them into the trainer.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxtoy.errors import UserError
from mlxtoy.engine import generate_batch
from mlxtoy.sampling import SamplingParams
from mlxtoy.train.data import PAD_MULTIPLE, Batch, BatchStream, DataStats, pack_rows
from mlxtoy.train.formats import Record, Renderer
from mlxtoy.train.rewards import RewardSet

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # added to the std before dividing (TRL's)
# what the loss returns after the loss itself, each a share of the step's mean (the min / max:
# each micro-batch's over its sequences, averaged over the micro-batches, as TRL logs them)
STATS = ("loss", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio", "entropy",
         "clip_ratio/low_min", "clip_ratio/high_max")
# how the ranks of a data-parallel step combine those two: the least / the largest (TRL's
# nanmin / nanmax over its processes), the others being shares of a mean, summed
EXTREMES = {"clip_ratio/low_min": "min", "clip_ratio/high_max": "max"}
SAMPLES_SHOWN = 4  # completions a step event carries


@dataclass(frozen=True)
class GRPOSpec:
    loss_type: str = "grpo"
    importance: str = "token"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    max_completion_tokens: int = 64
    detached_old: bool = True  # one iteration per generation: old = the policy itself, detached


# ------------------------------------------------------------------ advantages and the loss


def nanmean(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """The mean of the non-NaN values (NaN where there are none), quietly."""
    n = np.sum(~np.isnan(x), axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.nansum(x, axis=axis) / np.where(n > 0, n, np.nan)


def nanstd(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """The unbiased std of the non-NaN values, NaN where fewer than two (TRL's nanstd)."""
    n = np.sum(~np.isnan(x), axis=axis)
    mean = nanmean(x, axis)
    dev = x - (np.expand_dims(mean, axis) if axis is not None else mean)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sqrt(np.nansum(dev * dev, axis=axis) / np.where(n > 1, n - 1, np.nan))


def finite_or_none(v: float) -> float | None:
    """A metric's value for an event (JSON has no NaN): None where there was nothing to measure."""
    return float(v) if np.isfinite(v) else None


def group_advantages(rewards: np.ndarray, group_size: int, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """Rewards (N,) of N / group_size groups, in order -> (advantages (N,), each completion's
    group's (unbiased) reward std (N,), whatever `scale` is: the metrics and dynamic sampling
    read it): reward - group mean, over the group's std + STD_EPS, the batch's, or nothing.

    A NaN reward (every reward function said None: unscorable) is left out of its group's mean
    and std and gets advantage 0, as TRL >= 1.6 does; a group with fewer than two scored
    completions has std NaN, and advantages 0."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    group_std = nanstd(r, axis=1)
    # a group whose rewards are all equal has advantage 0 exactly (its float mean may not
    # equal its members to the last bit)
    adv = np.where(np.isclose(group_std, 0.0)[:, None], 0.0, r - nanmean(r, axis=1)[:, None]).reshape(-1)
    std = np.repeat(group_std, group_size)
    if scale == "batch":
        adv = adv / (nanstd(r) + STD_EPS)
    elif scale == "group":
        adv = adv / (std + STD_EPS)
    return np.nan_to_num(adv, nan=0.0).astype(np.float32), std


def grpo_loss(logp: mx.array, old: mx.array, ref: mx.array, adv: mx.array, mask: mx.array,
              spec: GRPOSpec, norms: mx.array, entropy: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """(loss, stats) of a micro-batch of completions (see the module docstring).

    logp, old, ref: (B, C) log-probs of each completion token under the policy, the generating
    policy and the reference (old is ignored when spec.detached_old); adv (B,); mask (B, C)
    1 where a completion has a token; norms [sequences of the step, completion tokens of the step,
    this micro-batch's completion tokens * micro-batches, micro-batches (1 when left out)];
    entropy (B, T) or None.
    stats: STATS, each a share of its mean over the step (tokens; sequences for GSPO's
    sequence-level clip fractions)."""
    old = mx.stop_gradient(logp) if spec.detached_old else mx.stop_gradient(old)
    log_ratio = logp - old
    if spec.importance == "sequence":
        lengths = mx.maximum(mask.sum(-1), 1.0)
        log_w = ((log_ratio * mask).sum(-1) / lengths)[:, None]
    else:
        log_w = log_ratio
    w = mx.exp(log_w)
    a = adv[:, None]
    per_token = -mx.minimum(w * a, mx.clip(w, 1 - spec.epsilon, 1 + spec.epsilon_high) * a)
    kl = mx.zeros_like(logp)
    if spec.beta:
        d = mx.stop_gradient(ref) - logp
        kl = mx.exp(d) - d - 1
        per_token = per_token + spec.beta * kl
    masked = per_token * mask
    if spec.loss_type == "grpo":
        loss = (masked.sum(-1) / mx.maximum(mask.sum(-1), 1.0)).sum() / norms[0]
    elif spec.loss_type == "bnpo":
        loss = masked.sum() / norms[2]
    elif spec.loss_type == "dr_grpo":
        loss = masked.sum() / (norms[0] * spec.max_completion_tokens)
    else:  # dapo
        loss = masked.sum() / norms[1]
    w = mx.stop_gradient(w)
    low = ((w < 1 - spec.epsilon) & (a < 0)).astype(mx.float32)
    high = ((w > 1 + spec.epsilon_high) & (a > 0)).astype(mx.float32)
    if spec.importance == "sequence":  # one ratio a sequence: fractions of the sequences
        present = (mask.sum(-1, keepdims=True) > 0).astype(mx.float32)
        shares = [(x * present).sum() / norms[0] for x in (low, high, mx.maximum(low, high))]
    else:
        shares = [(x * mask).sum() / norms[1] for x in (low, high, mx.maximum(low, high))]
    ent = mx.zeros(()) if entropy is None else (mx.stop_gradient(entropy) * mask).sum() / norms[1]
    micro_batches = norms[3] if norms.shape[0] > 3 else 1.0
    stats = mx.stack([loss, (mx.stop_gradient(kl) * mask).sum() / norms[1], *shares, ent,
                      *(x / micro_batches for x in sequence_extremes(low, high, mask))])
    return loss, stats


def sequence_extremes(low: mx.array, high: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    """(the least of the sequences' low-clipped shares, the largest of their high-clipped
    shares), TRL's clip_ratio/low_min and high_max: a share per sequence over its tokens (a
    sequence without tokens has none), or the sequence's own flag with one ratio a sequence."""
    if low.shape[1] == 1:  # sequence-level: one ratio, one flag a sequence
        return low[:, 0].min(), high[:, 0].max()
    n = mask.sum(-1)
    has = n > 0
    per_low = (low * mask).sum(-1) / mx.maximum(n, 1.0)
    per_high = (high * mask).sum(-1) / mx.maximum(n, 1.0)
    some = has.any()  # else TRL's NaN (nothing to measure), 0 here
    return (mx.where(some, mx.where(has, per_low, mx.inf).min(), 0.0),
            mx.where(some, mx.where(has, per_high, -mx.inf).max(), 0.0))


def step_norms(batches: list[Batch]) -> mx.array:
    """[sequences, completion tokens, micro-batches, micro-batches] of a whole step, for
    `grpo_loss` (completion tokens: the ones trained, truncated completions left out with
    --mask-truncated-completions); the third entry (bnpo's) is filled in per micro-batch by
    `micro_norms`, the fourth averages the per-micro-batch extremes."""
    n = float(len(batches))
    return mx.array([max(1, sum(b.inputs.shape[0] for b in batches)),
                     max(1, sum(b.n_loss for b in batches)), n, n], dtype=mx.float32)


def micro_norms(norms: mx.array, batch: Batch) -> mx.array:
    """`step_norms` with its third entry this micro-batch's tokens (all of them, not a
    data-parallel shard's) * the micro-batches."""
    return mx.concatenate([norms[:2], (norms[2] * max(1, batch.micro_tokens or batch.n_loss)).reshape(1), norms[3:]])


# ------------------------------------------------------------------ prompts


@dataclass
class Prompt:
    """One row to sample from: the prompt's token ids (ready for generation), its answer and
    every column of the row (what a reward may read)."""

    tokens: np.ndarray  # int32
    answer: Any
    row: dict[str, Any]
    where: str = ""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def trained(self) -> int:  # nothing of the prompt itself is trained
        return 0

    @property
    def prompt(self) -> Any:
        """The prompt as the row gives it: a string, or the list of messages."""
        return self.row["prompt"] if "prompt" in self.row else self.row.get("messages")


def tokenize_prompts(records: list[Record], tokenizer, seq_len: int, mask_prompt: bool = True,
                     name: str = "train") -> tuple[list[Prompt], DataStats]:
    """Records of kind "prompt" -> Prompts of at most seq_len tokens (longer ones are dropped
    and counted: a cut prompt asks another question). mask_prompt is ignored."""
    r = Renderer(tokenizer, True)
    out: list[Prompt] = []
    stats = DataStats(dropped_why=f"the prompt is longer than seq_len {seq_len}")
    for rec in records:
        _, answer, row = rec.value
        ids = rec.format.sequences(rec, r)[0][0]  # the prompt, ready for sampling
        if len(ids) > seq_len or not ids:
            stats.dropped += 1
            continue
        out.append(Prompt(np.asarray(ids, dtype=np.int32), answer, row, rec.where))
    if records and not out:
        raise UserError(f"{name}: every prompt ({stats.dropped}, e.g. {records[0].where}) is longer than "
                        f"--seq-len {seq_len}; raise it")
    stats.examples = len(out)
    stats.tokens = sum(len(p) for p in out)
    return out, stats


class PromptStream(BatchStream):
    """Deterministic batches of `batch_size` prompts: batch i is a pure function of (seed, i),
    as for the other objectives' batches (`prompts(i)`; rollouts make the training batches)."""

    def __post_init__(self):
        n = len(self.examples)
        self.rows = (pack_rows([len(p) for p in self.examples], self.seq_len, self.seed, pack=False)
                     if self.shuffle else [[i] for i in range(n)])

    def prompts(self, index: int) -> list[Prompt]:
        return [self.examples[row[0]] for row in self._rows_for(index)]


# ------------------------------------------------------------------ rollouts


@dataclass
class Rollout:
    """Completions of a micro-batch's prompts, scored, as a training batch."""

    batch: Batch
    rewards: np.ndarray  # (N,) combined
    per_reward: np.ndarray  # (N, rewards) with NaN for "not applicable"
    std: np.ndarray  # (N,) the std each advantage was scaled by (or would have been)
    lengths: np.ndarray  # (N,) completion tokens
    clipped: np.ndarray  # (N,) bool: stopped by the token limit, not EOS
    texts: list[str]
    prompts: list[Prompt]  # one per completion


def sample_seed(seed: int, positions: list[int]) -> int:
    """The sampling seed of a draw: a pure function of the run's seed and the data positions
    it samples (so a resumed run samples what the uninterrupted one did)."""
    return int(np.random.default_rng([seed, 0x6A90, *positions]).integers(0, 2**31 - 1))


def eval_seed(seed: int) -> int:
    """The sampling seed of --eval-generations: the run's, and the same at every evaluation."""
    return int(np.random.default_rng([seed, 0xE7A1]).integers(0, 2**31 - 1))


def generate_groups(model, tokenizer, prompts: list[Prompt], group_size: int, sampling: SamplingParams,
                    max_tokens: int, seed: int) -> tuple[list[list[int]], np.ndarray]:
    """group_size completions of each prompt (prompt-major), as token ids that end at the EOS
    (included) or the limit; and whether each was clipped by the limit."""
    eos = set(tokenizer.eos_ids)
    outs = generate_batch(model, [p.tokens.tolist() for p in prompts], repeats=group_size,
                          sampling=sampling, max_tokens=max_tokens, eos_ids=eos, seed=seed)
    clipped = np.array([not (o and o[-1] in eos) for o in outs])
    return outs, clipped


def completion_batch(prompts: list[Prompt], completions: list[list[int]], group_size: int,
                     pad_id: int, index: int, max_tokens: int, left_out: np.ndarray | None = None) -> Batch:
    """Rows prompt + completion (prompt-major, group_size per prompt), right-padded to a
    multiple of PAD_MULTIPLE; weights 1 on the completion's targets, and `positions` (rows,
    max_tokens) the targets' row positions (-1 past a completion's end): where the loss reads
    log-probs. Rows marked in `left_out` (truncated, --mask-truncated-completions) have no
    targets: they stay in the batch (their sequences count, as in TRL) but add no loss."""
    rows = [np.concatenate([prompts[i // group_size].tokens, np.asarray(c, dtype=np.int32)])
            for i, c in enumerate(completions)]
    width = max(len(r) - 1 for r in rows)
    width = -(-width // PAD_MULTIPLE) * PAD_MULTIPLE
    B = len(rows)
    inputs = np.full((B, width), pad_id, dtype=np.int32)
    targets = np.zeros((B, width), dtype=np.int32)
    weights = np.zeros((B, width), dtype=np.float32)
    segments = np.full((B, width), -1, dtype=np.int32)
    positions = np.full((B, max_tokens), -1, dtype=np.int32)
    for b, (row, comp) in enumerate(zip(rows, completions)):
        n = len(row) - 1
        inputs[b, :n], targets[b, :n], segments[b, :n] = row[:-1], row[1:], 0
        start = len(row) - len(comp) - 1  # the target of position start is the first completion token
        if left_out is not None and left_out[b]:
            continue
        weights[b, start:n] = 1.0
        positions[b, :len(comp)] = np.arange(start, n)
    batch = Batch(inputs, targets, weights, segments, int((segments >= 0).sum()), int(weights.sum()), index)
    batch.positions = positions
    return batch


def completion_arrays(batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, targets, mask), each (rows, max completion tokens), of a completion batch:
    where its completion tokens are, which they are, and which entries hold one."""
    valid = batch.positions >= 0
    pos = np.where(valid, batch.positions, 0)
    return pos, np.take_along_axis(batch.targets, pos, 1), valid.astype(np.float32)


def rollout(model, tokenizer, prompts: list[Prompt], rewards: RewardSet, *, group_size: int,
            sampling: SamplingParams, max_tokens: int, seed: int, scale: str, pad_id: int,
            index: int, mask_truncated: bool = False) -> Rollout:
    """Sample, decode and score group_size completions of each prompt; advantages on the Batch.
    mask_truncated: completions cut by max_tokens train nothing (DAPO's overlong filtering, TRL's
    mask_truncated_completions); they are still scored and counted in the metrics."""
    completions, clipped = generate_groups(model, tokenizer, prompts, group_size, sampling, max_tokens, seed)
    eos = set(tokenizer.eos_ids)
    texts = [tokenizer.decode([t for t in c if t not in eos]) for c in completions]
    owners = [prompts[i // group_size] for i in range(len(completions))]
    per_reward = rewards.score(owners, texts, [len(c) for c in completions])
    combined = rewards.combine(per_reward)
    adv, std = group_advantages(combined, group_size, scale)
    batch = completion_batch(prompts, completions, group_size, pad_id, index, max_tokens,
                             clipped if mask_truncated else None)
    batch.advantages = adv
    return Rollout(batch, combined, per_reward, std, np.array([len(c) for c in completions]), clipped,
                   texts, owners)


def informative(roll: Rollout, group_size: int) -> np.ndarray:
    """Per group: its (scored) rewards differ (DAPO's dynamic sampling keeps only these)."""
    std = roll.std.reshape(-1, group_size)[:, 0]
    return np.isfinite(std) & ~np.isclose(std, 0.0)


def keep_groups(roll: Rollout, keep: np.ndarray, group_size: int) -> Rollout:
    """The rollout restricted to the groups marked in `keep`."""
    return take_rows(roll, np.flatnonzero(np.repeat(keep, group_size)))


def split_rollout(roll: Rollout, parts: int, first_index: int) -> list[Rollout]:
    """One generation of several micro-batches' prompts -> a rollout per micro-batch (equal
    shares, whole groups), batch i numbered first_index + i."""
    n = len(roll.texts) // parts
    out = [take_rows(roll, np.arange(i * n, (i + 1) * n)) for i in range(parts)] if parts > 1 else [roll]
    for i, r in enumerate(out):
        r.batch.index = first_index + i
    return out


def take_rows(roll: Rollout, idx: np.ndarray) -> Rollout:
    """The rollout's completions `idx` (rows of its batch, in that order)."""
    b = roll.batch
    sub = Batch(b.inputs[idx], b.targets[idx], b.weights[idx], b.segments[idx], 0, 0, b.index)
    sub.n_tokens, sub.n_loss = int((sub.segments >= 0).sum()), int(sub.weights.sum())
    sub.advantages, sub.positions = b.advantages[idx], b.positions[idx]
    return Rollout(sub, roll.rewards[idx], roll.per_reward[idx], roll.std[idx], roll.lengths[idx],
                   roll.clipped[idx], [roll.texts[i] for i in idx], [roll.prompts[i] for i in idx])


def rollout_metrics(rolls: list[Rollout], rewards: RewardSet, group_size: int) -> dict[str, Any]:
    """TRL's (>= 1.6) metric names and definitions over every completion sampled for a step
    (skipped groups included): the reward's mean and std over the completions (an unscorable
    one left out), each reward's mean and std where it applied, the share of groups whose
    rewards are all equal, completion lengths (all, and those that ended with EOS), the share
    cut by the token limit. None where there was nothing to measure."""
    r = np.concatenate([x.rewards for x in rolls])
    per = np.concatenate([x.per_reward for x in rolls])
    lengths = np.concatenate([x.lengths for x in rolls]).astype(np.float64)
    clipped = np.concatenate([x.clipped for x in rolls])
    groups = np.concatenate([x.std.reshape(-1, group_size)[:, 0] for x in rolls])
    out: dict[str, Any] = {"reward": finite_or_none(nanmean(r)), "reward_std": finite_or_none(nanstd(r)),
                           "frac_reward_zero_std": float(np.isclose(groups, 0.0).mean())}
    for j, name in enumerate(rewards.names):
        out[f"rewards/{name}/mean"] = finite_or_none(nanmean(per[:, j]))
        out[f"rewards/{name}/std"] = finite_or_none(nanstd(per[:, j]))
    out["completions/mean_length"] = float(lengths.mean())
    out["completions/min_length"] = float(lengths.min())
    out["completions/max_length"] = float(lengths.max())
    out["completions/clipped_ratio"] = float(clipped.mean())
    ended = lengths[~clipped] if (~clipped).any() else np.zeros(1)  # TRL's 0 when none ended
    out["completions/mean_terminated_length"] = float(ended.mean())
    out["completions/min_terminated_length"] = float(ended.min())
    out["completions/max_terminated_length"] = float(ended.max())
    return out


def sampled_tokens(rolls: list[Rollout]) -> int:
    """Prompt and completion tokens of every completion sampled (TRL's num_tokens counts these)."""
    return int(sum(len(p) for x in rolls for p in x.prompts) + sum(int(x.lengths.sum()) for x in rolls))


def sample_records(rolls: list[Rollout], rewards: RewardSet, n: int = SAMPLES_SHOWN) -> list[dict[str, Any]]:
    """A few completions of the step with their rewards (the first group's first ones)."""
    out = []
    for roll in rolls:
        for i in range(len(roll.texts)):
            if len(out) >= n:
                return out
            per = {name: (None if math.isnan(v) else float(v)) for name, v in zip(rewards.names, roll.per_reward[i])}
            prompt = roll.prompts[i].prompt
            shown = prompt if isinstance(prompt, str) else next(
                (m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
            out.append({"prompt": str(shown)[:200], "completion": roll.texts[i][:400],
                        "reward": finite_or_none(roll.rewards[i]), "rewards": per})
    return out


@dataclass
class StepRollouts:
    """What a GRPO step trains on and reports."""

    rolls: list[Rollout]  # one per micro-batch
    positions: int  # data positions (prompt batches) consumed
    seen: list[Rollout]  # every draw, the groups dynamic sampling dropped included (the metrics)


def collect(draw: Callable[[list[int]], Rollout], position: int, micro_batches: int, batch_size: int,
            group_size: int, skip_zero_std: bool, max_draws: int) -> StepRollouts:
    """The micro-batches of one step: `draw(positions)` rolls out the prompts of those data
    positions as one generation; the step's micro-batches are one draw, split. With
    `skip_zero_std`, groups whose rewards are all equal are dropped and refilled from the next
    positions (at most `max_draws` draws per micro-batch; a micro-batch that stays short
    trains on what it has)."""
    first = draw(list(range(position, position + micro_batches)))
    rolls, seen, pos = split_rollout(first, micro_batches, position), [first], position + micro_batches
    for i, roll in enumerate(rolls if skip_zero_std else []):
        kept = keep_groups(roll, informative(roll, group_size), group_size)
        draws = 1
        while len(kept.texts) < batch_size * group_size and draws < max_draws:
            more = draw([pos])
            pos += 1
            draws += 1
            seen.append(more)
            kept = merge(kept, keep_groups(more, informative(more, group_size), group_size), batch_size * group_size)
        if len(kept.texts):  # else every group was equal: its advantages are all 0
            rolls[i] = kept
    return StepRollouts(rolls, pos - position, seen)


def merge(a: Rollout, b: Rollout, limit: int) -> Rollout:
    """a's completions then b's, at most `limit` (whole groups: limit is a multiple of G)."""
    n_b = max(0, min(len(b.texts), limit - len(a.texts)))
    width = max(a.batch.inputs.shape[1], b.batch.inputs.shape[1])

    def pad(x: np.ndarray, value) -> np.ndarray:
        return np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=value)

    ab, bb = a.batch, b.batch  # (padding inputs are never seen: rows are right-padded)
    batch = Batch(np.concatenate([pad(ab.inputs, 0), pad(bb.inputs[:n_b], 0)]),
                  np.concatenate([pad(ab.targets, 0), pad(bb.targets[:n_b], 0)]),
                  np.concatenate([pad(ab.weights, 0), pad(bb.weights[:n_b], 0)]),
                  np.concatenate([pad(ab.segments, -1), pad(bb.segments[:n_b], -1)]), 0, 0, ab.index)
    batch.n_tokens, batch.n_loss = int((batch.segments >= 0).sum()), int(batch.weights.sum())
    batch.advantages = np.concatenate([ab.advantages, bb.advantages[:n_b]])
    batch.positions = np.concatenate([ab.positions, bb.positions[:n_b]])
    cat = lambda x, y: np.concatenate([x, y[:n_b]])  # noqa: E731
    return Rollout(batch, cat(a.rewards, b.rewards), cat(a.per_reward, b.per_reward), cat(a.std, b.std),
                   cat(a.lengths, b.lengths), cat(a.clipped, b.clipped), a.texts + b.texts[:n_b],
                   a.prompts + b.prompts[:n_b])


# ------------------------------------------------------------------ evaluation and checkpoints


def greedy_rewards(model, tokenizer, prompts: list[Prompt], rewards: RewardSet, max_tokens: int,
                   rows: int) -> dict[str, Any]:
    """The eval event's values: the mean combined reward of one greedy completion of each
    prompt (`rows` prompts decoded together), each reward's mean and the mean length."""
    texts, lengths = [], []
    eos = set(tokenizer.eos_ids)
    for i in range(0, len(prompts), rows):
        outs = generate_batch(model, [p.tokens.tolist() for p in prompts[i:i + rows]],
                              sampling=SamplingParams(temp=0.0), max_tokens=max_tokens, eos_ids=eos)
        texts += [tokenizer.decode([t for t in o if t not in eos]) for o in outs]
        lengths += [len(o) for o in outs]
    per = rewards.score(prompts, texts, lengths)
    out: dict[str, Any] = {"reward": float(nanmean(rewards.combine(per))) if prompts else float("nan"),
                           "completions/mean_length": float(np.mean(lengths or [0]))}
    for j, name in enumerate(rewards.names):
        out[f"rewards/{name}/mean"] = finite_or_none(nanmean(per[:, j]))
    return out


def sampled_rewards(model, tokenizer, prompts: list[Prompt], rewards: RewardSet, max_tokens: int, rows: int,
                    sampling: SamplingParams, generations: int, seed: int) -> dict[str, Any]:
    """--eval-generations: `generations` completions of each prompt sampled as the training
    samples them (a fixed seed: every evaluation draws alike), beside the greedy one; TRL's
    eval reward. Keys under "sampled/": the reward's mean and std over the completions, each
    reward's mean, the mean length."""
    texts, lengths, owners = [], [], []
    eos = set(tokenizer.eos_ids)
    per_call = max(1, rows // generations)
    for i in range(0, len(prompts), per_call):
        chunk = prompts[i:i + per_call]
        outs = generate_batch(model, [p.tokens.tolist() for p in chunk], repeats=generations, sampling=sampling,
                              max_tokens=max_tokens, eos_ids=eos, seed=seed + i)
        texts += [tokenizer.decode([t for t in o if t not in eos]) for o in outs]
        lengths += [len(o) for o in outs]
        owners += [p for p in chunk for _ in range(generations)]
    per = rewards.score(owners, texts, lengths)
    combined = rewards.combine(per)
    out: dict[str, Any] = {"sampled/reward": finite_or_none(nanmean(combined)),
                           "sampled/reward_std": finite_or_none(nanstd(combined)),
                           "sampled/completions/mean_length": float(np.mean(lengths or [0]))}
    for j, name in enumerate(rewards.names):
        out[f"sampled/rewards/{name}/mean"] = finite_or_none(nanmean(per[:, j]))
    return out


SAVED_ARRAYS = ("inputs", "targets", "weights", "segments", "advantages", "positions", "old_logps", "ref_logps")
SAVED_COUNTS = ("n_tokens", "n_loss", "index", "micro_tokens")


def saved_generation(batches: list[Batch], meta: dict[str, Any]) -> tuple[dict[str, mx.array], dict[str, str]]:
    """A generation's micro-batches (with their advantages and stored log-probs) and `meta`
    as a checkpoint keeps them (arrays, metadata)."""
    arrays = {f"{i}.{k}": mx.array(getattr(b, k)) for i, b in enumerate(batches) for k in SAVED_ARRAYS}
    meta = dict(meta, counts=[[getattr(b, k) for k in SAVED_COUNTS] for b in batches])
    return arrays, {"grpo": json.dumps(meta)}


def restored_generation(arrays: dict[str, mx.array], metadata: dict[str, str]) -> tuple[list[Batch], dict[str, Any]]:
    """`saved_generation` read back: (micro-batches, meta)."""
    meta = json.loads(metadata["grpo"])
    batches = []
    for i, counts in enumerate(meta["counts"]):
        b = Batch(*(np.array(arrays[f"{i}.{k}"]) for k in SAVED_ARRAYS[:4]))
        for k in SAVED_ARRAYS[4:]:
            setattr(b, k, np.array(arrays[f"{i}.{k}"]))
        for k, v in zip(SAVED_COUNTS, counts):
            setattr(b, k, v)
        batches.append(b)
    return batches, meta
