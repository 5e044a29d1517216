"""The training objectives: each one class owning its data, batches, loss, metrics and memory
estimate (`Objective`; `make_objective(cfg)` picks it). The loop, the job, the Stepper and the
memory guard call these methods and never branch on the objective's name: adding an objective
is a class here (and its module) plus its tests.

- sft: token-weighted cross-entropy (`token_losses`, with a hand-written fast gradient).
- dpo, orpo (mlxtoy.train.preference): the preference losses on pairs, against a reference
  (DPO) or none (ORPO).
- grpo (mlxtoy.train.grpo): completions sampled in the step, scored by reward functions
  (mlxtoy.train.rewards), a clipped-ratio policy-gradient loss on group-relative advantages.

Every sum is divided by a count of the whole optimizer step (pairs, chosen tokens, sequences)
computed on the host, so micro-batches and data-parallel shards add up to the one-batch
result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.events import Metric
from mlxtoy.rundir import REFERENCE_LOGPS, RunDir
from mlxtoy.sampling import SamplingParams
from mlxtoy.train import grpo
from mlxtoy.train.checkpoint import load_reference, save_reference
from mlxtoy.train.data import PAD_MULTIPLE, Batch, BatchStream, Dataset, tokenize
from mlxtoy.train.formats import ChatFormat, CompletionFormat, PairFormat, PromptFormat, StreamFormat, TextFormat
from mlxtoy.train.logprobs import (completion_logps, cross_entropy, loss_logits_alive,  # noqa: F401
                                   output_cross_entropy, output_layer, token_losses)
from mlxtoy.train.pairs import PairStream, tokenize_pairs
from mlxtoy.train.preference import PreferenceSpec, adapters_disabled, pair_logps, preference_loss
from mlxtoy.train.records import RawSplits, check_kinds
from mlxtoy.train.rewards import RewardSet


def sft_loss(model: nn.Module, inputs: mx.array, targets: mx.array, weights: mx.array,
             segments: mx.array | None, norm: mx.array) -> mx.array:
    """Token-weighted cross-entropy sum / norm (the trained tokens of the whole step)."""
    ce = token_losses(model, inputs, targets, segments)
    return (ce.astype(mx.float32) * weights).sum() / norm



# ------------------------------------------------------------------ the objectives as components


def batch_arrays(batch: Batch, packed: bool) -> tuple[mx.array, ...]:
    # Rows holding one document each (padding only at the end) need no block mask: the plain
    # causal mask gives the same losses, and the fused kernel skips a (B, H, T, T) select.
    segs = mx.array(batch.segments) if packed and batch.segments.max() > 0 else None
    return mx.array(batch.inputs), mx.array(batch.targets), mx.array(batch.weights), segs


def pair_arrays(batch: Batch, packed: bool) -> tuple[mx.array, ...]:
    """batch_arrays plus what a preference objective reads: sequence ids and reference log-probs."""
    return (*batch_arrays(batch, packed), mx.array(batch.seq), mx.array(batch.ref))


@dataclass
class Setup:
    """What an objective may need before step 1 and between steps (the loop fills it in)."""

    model: nn.Module
    tokenizer: Any
    stepper: Any  # mlxtoy.train.step.Stepper: compiled functions on the model's state
    dataset: Dataset
    run: RunDir
    resume_from: str | None
    parallel: Any  # mlxtoy.train.loop.Parallel or None
    pad_id: int
    log: Callable[..., None]  # log(message, level="info")
    quiet: Callable[[], ContextManager]  # leaves the training RNG where it was (exact resume)
    train_stream: BatchStream
    valid_stream: BatchStream | None


@dataclass
class StepData:
    """One optimizer step's micro-batches, the data positions they used, and what the step
    event should carry besides the loss's own statistics."""

    batches: list[Batch]
    positions: int
    metrics: dict[str, Any]


class Objective:
    """The base: SFT's choices, which the others override where they differ."""

    name = "sft"
    # what the displays show of its runs (the CLI's progress line, the TUI's Train and Runs
    # screens): the step events' values and the eval events', the first of each the headline
    step_shows: tuple[Metric, ...] = (Metric("loss", "loss"),)
    eval_shows: tuple[Metric, ...] = (Metric("val_loss", "val"), Metric("val_ppl", "ppl", ".2f", chart=False))
    # the record kinds it trains on (mlxtoy.train.formats)
    kinds: tuple[str, ...] = (TextFormat.kind, CompletionFormat.kind, ChatFormat.kind, StreamFormat.kind)
    wanted: str | None = None  # how errors describe those kinds (None: the general formats)
    # entries of the step's statistics (`value`) that data-parallel ranks combine by "min" or
    # "max" instead of a sum, by index
    extremes: dict[int, str] = {}

    def __init__(self, cfg: TrainConfig):
        """cfg: validated (TrainConfig.validate resolves beta); built once per run, by the job."""
        if cfg.beta is None:
            raise ValueError("an objective takes a TrainConfig whose beta is resolved (validate, resolve_beta)")
        self.cfg = cfg
        self.setup: Setup | None = None

    @classmethod
    def shows(cls) -> dict[str, list[list[str]]]:
        """The display declaration, as the start event carries it (events.shows_of reads it)."""
        return {"step": [[m.key, m.label, m.fmt, m.chart] for m in cls.step_shows],
                "eval": [[m.key, m.label, m.fmt, m.chart] for m in cls.eval_shows]}

    # -- data
    def check_records(self, raw: RawSplits) -> None:
        check_kinds(raw, self.name, self.kinds, self.wanted)

    def tokenize(self, records, tokenizer, seq_len: int, mask_prompt: bool = True, name: str = "train"):
        return tokenize(records, tokenizer, seq_len, mask_prompt, name=name)

    def stream(self, examples: list, shuffle: bool, pad_id: int) -> BatchStream:
        c = self.cfg
        return BatchStream(examples, c.batch_size, c.seq_len, c.seed, c.pack, shuffle, pad_id)

    def data_warnings(self, dataset: Dataset) -> list[str]:
        return []

    # -- before step 1
    def starting_point(self, model: nn.Module) -> None:
        """The model before a resumed run's checkpoint is loaded into it (the run's start)."""

    def prepare(self, setup: Setup) -> None:
        self.setup = setup

    def state(self) -> tuple[dict[str, mx.array], dict[str, str]] | None:
        """What a checkpoint must keep of the objective itself (arrays, metadata), if anything."""
        return None

    def load_state(self, state: tuple[dict[str, mx.array], dict[str, str]] | None) -> None:
        """Take back `state` from a resumed run's checkpoint."""

    # -- a step
    def step_data(self, stream: BatchStream, position: int) -> StepData:
        return StepData([stream.batch(position + k) for k in range(self.cfg.grad_accum)], self.cfg.grad_accum, {})

    def args(self, batch: Batch, packed: bool, norm: mx.array) -> tuple:
        return (*batch_arrays(batch, packed), norm)

    def norm(self, batches: list[Batch]) -> mx.array:
        return mx.array(max(1, sum(b.n_loss for b in batches)), dtype=mx.float32)

    def loss(self, model: nn.Module, *args) -> Any:
        """The step's loss (traced into the compiled step): what `value` and `scalar` read."""
        return sft_loss(model, *args)

    def value(self, out: Any) -> mx.array:
        """What a step returns of the loss function's output (the loss, or its statistics)."""
        return out

    def scalar(self, value: mx.array) -> mx.array:
        return value

    def step_fields(self, out: Any) -> tuple[float, dict[str, Any]]:
        """(loss, the step event's other fields) from the step's returned value, as a list."""
        return (out[0] if isinstance(out, list) else out), {}

    # -- evaluation
    def eval_value(self, model: nn.Module, inputs, targets, weights, segments) -> mx.array:
        ce = token_losses(model, inputs, targets, segments, train=False)
        return (ce * weights).sum()

    def evaluate(self, stepper, stream: BatchStream, n_batches: int) -> tuple[float, int, dict[str, Any]]:
        """Mean loss over the first `n_batches` validation batches (-1: all), the count it is a
        mean over, and the eval event's other fields."""
        total, count = 0.0, 0
        for b in stream.epoch_batches(n_batches):
            part = stepper.reducer.shard(b) if stepper.reducer is not None else b
            if part.inputs.shape[0] and part.n_loss:  # a shard of a short last batch may be empty
                total += stepper.eval_fn(*batch_arrays(part, stepper.packed)).item()
            count += part.n_loss
        if stepper.reducer is not None:
            total, count = stepper.reducer.reduce_eval(total, count)
        return (total / count if count else float("nan")), count, {}

    # -- the memory estimate
    def memory_rows(self, batch_size: int, seq_len: int) -> tuple[int, int]:
        """(rows, row length) of a step's micro-batch."""
        return batch_size, seq_len

    def memory_loss_tokens(self, rows: int, width: int, fused: bool) -> int:
        """Tokens of a micro-batch whose logits the loss computes (`fused`: the output layer
        runs through the chunked loss, which can take a subset of the positions)."""
        return rows * width

    def memory_decode(self, batch_size: int, grad_accum: int) -> tuple[int, int, int] | None:
        """(rows decoded together, prompt tokens, generated tokens) of the batched decoding a
        step runs before its update (its own peak: the KV cache), or None."""
        return None

    def memory_measure(self, raw: RawSplits, tokenizer: Callable[[], Any]) -> bool:
        """Before the data is tokenized (the preflight): measure what `memory_rows` bounds by
        seq_len until then; -> whether anything was (False: the rows are already exact)."""
        return False

    def memory_extra_logits(self, tokens: int, vocab: int) -> int:
        """Bytes of vocabulary-wide arrays beyond the policy's loss (unfused loss path)."""
        return 0

    def memory_extra(self, trainable_bytes: int) -> int:
        """Bytes the objective keeps besides the step (a reference copy of the weights)."""
        return 0


class SFT(Objective):
    """Supervised next-token prediction: the base class's choices."""


class Preference(Objective):
    """Preference pairs (DPO, ORPO): batches of whole pairs, a loss with statistics."""

    kinds = (PairFormat.kind,)
    wanted = ('preference pairs ({"prompt","chosen","rejected"} or {"chosen": [messages], '
              '"rejected": [messages]})')
    step_shows = (Metric("loss", "loss"), Metric("reward_margin", "margin", ".3f"), Metric("pref_accuracy", "acc", ".0%"))
    eval_shows = (Metric("val_loss", "val"), Metric("pref_accuracy", "val acc", ".0%"))

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.spec = PreferenceSpec(self.name, cfg.beta, cfg.label_smoothing, adapters_reference=cfg.adapters)

    def tokenize(self, records, tokenizer, seq_len: int, mask_prompt: bool = True, name: str = "train"):
        return tokenize_pairs(records, tokenizer, seq_len, mask_prompt, name=name)

    def stream(self, examples: list, shuffle: bool, pad_id: int) -> BatchStream:
        c = self.cfg
        return PairStream(examples, c.batch_size, c.seq_len, c.seed, c.pack, shuffle, pad_id)

    def data_warnings(self, dataset: Dataset) -> list[str]:
        return [f"{name}: {stats.dropped} preference pairs dropped ({stats.dropped_why})"
                for name, stats in (("train", dataset.train_stats), ("valid", dataset.valid_stats)) if stats.dropped]

    def args(self, batch: Batch, packed: bool, norm: mx.array) -> tuple:
        return (*pair_arrays(batch, packed), norm)

    def norm(self, batches: list[Batch]) -> mx.array:
        # pairs, and chosen tokens (ORPO's NLL is a mean over tokens)
        return mx.array([max(1, sum(len(b.pairs) for b in batches)),
                         max(1, sum(b.n_chosen for b in batches))], dtype=mx.float32)

    def loss(self, model: nn.Module, *args) -> Any:
        return preference_loss(model, self.spec, *args)

    def value(self, out: Any) -> mx.array:
        return out[1]

    def scalar(self, value: mx.array) -> mx.array:
        return value[0]

    def step_fields(self, out: Any) -> tuple[float, dict[str, Any]]:
        # [loss, reward_chosen, reward_rejected, accuracy]
        return out[0], {"reward_chosen": out[1], "reward_rejected": out[2], "reward_margin": out[1] - out[2],
                        "pref_accuracy": out[3]}

    def eval_value(self, model: nn.Module, *args) -> mx.array:
        return preference_loss(model, self.spec, *args, train=False)[1]

    def evaluate(self, stepper, stream: BatchStream, n_batches: int) -> tuple[float, int, dict[str, Any]]:
        batches = list(stream.epoch_batches(n_batches))
        norm = self.norm(batches)
        sums = [0.0] * 4
        for b in batches:
            part = stepper.reducer.shard(b) if stepper.reducer is not None else b
            if part.inputs.shape[0]:
                sums = [a + float(v) for a, v in zip(sums, stepper.eval_fn(*self.args(part, stepper.packed, norm)).tolist())]
        count = sum(len(b.pairs) for b in batches)
        if stepper.reducer is not None:  # each a share of the one-process mean: their sum is it
            sums = [stepper.reducer.reduce_eval(v, 0)[0] for v in sums]
        loss, rc, rr, acc = sums
        return loss, count, {"pref_accuracy": acc, "reward_margin": rc - rr}

    def memory_rows(self, batch_size: int, seq_len: int) -> tuple[int, int]:
        # a preference batch holds pairs (two sequences each)
        return (batch_size, 2 * seq_len) if self.cfg.pack else (2 * batch_size, seq_len)


class ORPO(Preference):
    name = "orpo"


class DPO(Preference):
    """DPO: with adapters the reference is the base (adapters off, inside the loss); for full
    fine-tuning, log-probs of every pair computed once before step 1 and kept in the run."""

    name = "dpo"

    def prepare(self, setup: Setup) -> None:
        super().prepare(setup)
        if self.cfg.adapters:
            return
        refs = self._reference_logps(setup)
        setup.train_stream.ref = refs["train"]
        if setup.valid_stream is not None:
            setup.valid_stream.ref = refs["valid"]

    def memory_extra_logits(self, tokens: int, vocab: int) -> int:
        return tokens * vocab * 4 if self.cfg.adapters else 0  # the reference's forward

    def _reference_logps(self, s: Setup) -> dict[str, np.ndarray]:
        """The starting model's log-probs of every train / valid pair, computed once before
        step 1 and kept in the run (a resumed run's weights have moved on: it reuses them).
        Data-parallel: rank 0 computes or reads them and shares them."""
        splits = {"train": s.dataset.train, "valid": s.dataset.valid}
        shapes = {k: (len(v), 2) for k, v in splits.items()}
        main = s.parallel is None or s.parallel.is_main
        refs: dict[str, np.ndarray] | None = None
        if main:
            refs = load_reference(s.run, shapes)
            if refs is not None:
                s.log(f"reference log-probs: reusing {s.run.join(REFERENCE_LOGPS)}")
            elif s.resume_from is not None:
                raise UserError(f"{s.run.join(REFERENCE_LOGPS)}: missing, and a resumed run cannot recompute "
                                f"the reference (its weights have moved)")
            else:
                s.log(f"reference log-probs of {len(s.dataset.train) + len(s.dataset.valid)} pairs (the starting model)")
                s.model.eval()
                with s.quiet():
                    refs = {k: self._logps(s, self.stream(v, False, s.pad_id)) if v else np.zeros((0, 2), np.float32)
                            for k, v in splits.items()}
                s.model.train()
                save_reference(s.run, refs)
        if s.parallel is not None:
            got = s.parallel.broadcast({k: mx.array(refs[k] if main else np.zeros(shapes[k], np.float32))
                                        for k in splits if shapes[k][0]}, "sharing the reference log-probs")
            refs = {k: np.array(got[k]) if k in got else np.zeros((0, 2), np.float32) for k in splits}
        return refs

    def _logps(self, s: Setup, stream: BatchStream) -> np.ndarray:
        """(pairs, 2) summed completion log-probs of every pair of `stream` (unshuffled)."""
        model = s.model
        logps = mx.compile(lambda inputs, targets, weights, segments, seq, ref: pair_logps(
            model, inputs, targets, weights, segments, seq, ref.shape[0]), inputs=s.stepper.state)
        out = np.zeros((len(stream.examples), 2), dtype=np.float32)
        for b in stream.epoch_batches(-1):
            out[b.pairs] = np.array(logps(*pair_arrays(b, s.stepper.packed)))
        return out


class GRPO(Objective):
    """GRPO and its variants (mlxtoy.train.grpo): each step samples completions of its prompts
    with the current weights, scores them and trains on the clipped-ratio loss. The reference
    (beta > 0) is the base with the adapters off for LoRA and DoRA, and the run's starting
    weights, kept in memory, for full fine-tuning."""

    name = "grpo"
    default_beta = 0.0
    kinds = (PromptFormat.kind,)
    wanted = 'prompt rows ({"prompt","answer"} or {"messages": [...], "answer"})'
    # the headline is the reward (its loss is near 0 by construction), the greedy one held out
    step_shows = (Metric("reward", "reward", ".3f"), Metric("loss", "loss"),
                  Metric("completions/mean_length", "len", ".1f"))
    eval_shows = (Metric("reward", "val reward", ".3f"),)
    max_refill_draws = 4  # --skip-zero-std-groups: prompt batches drawn per micro-batch at most
    extremes = {grpo.STATS.index(key): how for key, how in grpo.EXTREMES.items()}

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        if cfg.group_size < 2:
            raise UserError(f"train config: group_size must be >= 2 (advantages compare completions of a "
                            f"prompt), got {cfg.group_size}")
        self.rewards = RewardSet.parse(cfg.reward, cfg.reward_weights, cfg.reward_timeout)
        self.spec = grpo.GRPOSpec(cfg.loss_type, cfg.importance_sampling, cfg.epsilon,
                                  cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high, cfg.beta,
                                  cfg.max_completion_tokens, detached_old=cfg.iterations_per_generation == 1)
        # the penalty sees the whole prompt and completion, as TRL's samplers do
        self.sampling = SamplingParams(temp=cfg.temp, top_p=cfg.top_p, min_p=cfg.min_p, top_k=cfg.top_k,
                                       repetition_penalty=cfg.repetition_penalty,
                                       repetition_window=cfg.seq_len + cfg.max_completion_tokens).validate()
        self.reference: dict[str, mx.array] | None = None  # full fine-tuning's starting weights
        self.reused: tuple[StepData, int] | None = None  # a generation, and the steps it has served
        self.pending: dict[str, Any] = {}  # the rollout's metrics, for the step event
        self.num_tokens = 0  # prompt + completion tokens sampled so far in the run (TRL's num_tokens)
        self.warned_unscorable = False
        self.longest_prompt = 0  # tokens, over the splits tokenized (the memory estimate's rows)

    def check_records(self, raw: RawSplits) -> None:
        super().check_records(raw)
        # each reward meets the first row before the model loads (signature, columns, return
        # type), with its answer as the completion
        if not raw.train:
            return
        rec = raw.train[0]
        _, answer, row = rec.value
        self.rewards.score([grpo.Prompt(np.zeros(0, np.int32), answer, row, rec.where)], [str(answer)], [1])

    def tokenize(self, records, tokenizer, seq_len: int, mask_prompt: bool = True, name: str = "train"):
        prompts, stats = grpo.tokenize_prompts(records, tokenizer, seq_len, mask_prompt, name=name)
        # the memory estimate's rows: training and the held-out evaluation decode these
        self.longest_prompt = max([self.longest_prompt, *map(len, prompts)])
        return prompts, stats

    def stream(self, examples: list, shuffle: bool, pad_id: int) -> BatchStream:
        c = self.cfg
        return grpo.PromptStream(examples, c.batch_size, c.seq_len, c.seed, False, shuffle, pad_id)

    def data_warnings(self, dataset: Dataset) -> list[str]:
        out = [f"{name}: {stats.dropped} prompts dropped ({stats.dropped_why})"
               for name, stats in (("train", dataset.train_stats), ("valid", dataset.valid_stats)) if stats.dropped]
        if self.cfg.importance_sampling == "sequence" and self.cfg.loss_type in ("bnpo", "dr_grpo", "dapo"):
            # TRL's warning: the setting is allowed, and rarely what was meant
            out.append(f"--importance-sampling sequence with --loss-type {self.cfg.loss_type}: that loss sums "
                       f"per-token terms, which weights each sequence by its completion length instead of "
                       f"optimizing the per-sequence objective; GSPO's setup is --loss-type grpo")
        return out

    def starting_point(self, model: nn.Module) -> None:
        if self.cfg.beta and not self.cfg.adapters:  # the arrays themselves: updates make new ones
            self.reference = dict(tree_flatten(model.trainable_parameters()))

    # -- a generation that later steps still train on (--iterations-per-generation) is state
    # (and the count of tokens sampled, so a resumed run's num_tokens goes on from it)
    def state(self) -> tuple[dict[str, mx.array], dict[str, str]] | None:
        if self.reused is None or self.reused[1] >= self.cfg.iterations_per_generation:
            return grpo.saved_generation([], {"num_tokens": self.num_tokens})
        data, uses = self.reused
        return grpo.saved_generation(data.batches, {"uses": uses, "positions": data.positions, "metrics": data.metrics,
                                                    "num_tokens": self.num_tokens})

    def load_state(self, state: tuple[dict[str, mx.array], dict[str, str]] | None) -> None:
        if state is not None:
            batches, meta = grpo.restored_generation(*state)
            self.num_tokens = meta.get("num_tokens", 0)  # a checkpoint from before the count: from 0
            if batches:
                self.reused = (StepData(batches, meta["positions"], meta["metrics"]), meta["uses"])

    # -- a step: rollouts, then the loss on them
    def step_data(self, stream: BatchStream, position: int) -> StepData:
        if self.reused is not None and self.reused[1] < self.cfg.iterations_per_generation:
            data, uses = self.reused
            self.reused = (data, uses + 1)
            self.pending = dict(data.metrics)
            return StepData(data.batches, 0, data.metrics)
        s, c = self.setup, self.cfg
        t0 = time.perf_counter()

        def draw(positions: list[int]) -> grpo.Rollout:  # all these prompts' completions, one batch
            prompts = [p for pos in positions for p in stream.prompts(pos)]
            return grpo.rollout(s.model, s.tokenizer, prompts, self.rewards, group_size=c.group_size,
                                sampling=self.sampling, max_tokens=c.max_completion_tokens,
                                seed=grpo.sample_seed(c.seed, positions), scale=c.scale_rewards,
                                pad_id=s.pad_id, index=positions[0], mask_truncated=c.mask_truncated_completions)

        s.model.eval()
        with s.quiet():
            got = grpo.collect(draw, position, c.grad_accum, c.batch_size, c.group_size,
                               c.skip_zero_std_groups, self.max_refill_draws)
            t1 = time.perf_counter()
            batches = [r.batch for r in got.rolls]
            for b in batches:
                b.micro_tokens = b.n_loss  # bnpo's normaliser, whatever share of it a rank trains on
                self._score(b)
        s.model.train()
        seen = got.seen
        self.num_tokens += grpo.sampled_tokens(seen)
        metrics = grpo.rollout_metrics(seen, self.rewards, c.group_size)
        metrics["num_tokens"] = self.num_tokens
        metrics["samples"] = grpo.sample_records(seen, self.rewards)
        self._warn_unscorable(seen)
        metrics["timing/generation_s"] = t1 - t0
        metrics["timing/scoring_s"] = time.perf_counter() - t1
        data = StepData(batches, got.positions, metrics)
        self.reused = (data, 1)
        self.pending = dict(metrics)
        return data

    def _warn_unscorable(self, rolls: list[grpo.Rollout]) -> None:
        """Once a run, as TRL warns: a completion whose every reward said None trains nothing."""
        for roll in rolls:
            bad = np.flatnonzero(np.isnan(roll.rewards))
            if len(bad) and not self.warned_unscorable:
                self.warned_unscorable = True
                self.setup.log(f"every reward returned None for a completion of {roll.prompts[bad[0]].where}: "
                               f"it is left out of its group's baseline, with advantage 0 (make at least one "
                               f"reward return a number)", "warning")

    def _score(self, batch: Batch) -> None:
        """The log-probs the loss compares with, stored with the batch right after generation:
        the generating policy's (several iterations per generation) and the reference's."""
        model = self.setup.model
        pos, targets, _ = grpo.completion_arrays(batch)
        args = mx.array(batch.inputs), mx.array(pos), mx.array(targets)

        def logps() -> np.ndarray:
            return np.array(completion_logps(model, *args, train=False, entropy=False, temperature=self.cfg.temp)[0])

        zeros = np.zeros(pos.shape, np.float32)
        batch.old_logps, batch.ref_logps = zeros, zeros
        if not self.spec.detached_old:
            batch.old_logps = logps()
        if not self.cfg.beta:
            return
        if self.cfg.adapters:
            with adapters_disabled(model):
                batch.ref_logps = logps()
            return
        current = model.trainable_parameters()
        model.update(tree_unflatten(list(self.reference.items())))
        try:
            batch.ref_logps = logps()
        finally:
            model.update(current)

    def args(self, batch: Batch, packed: bool, norm: mx.array) -> tuple:
        pos, targets, mask = grpo.completion_arrays(batch)
        return (mx.array(batch.inputs), mx.array(pos), mx.array(targets), mx.array(mask),
                mx.array(batch.advantages), mx.array(batch.old_logps), mx.array(batch.ref_logps),
                grpo.micro_norms(norm, batch))

    def norm(self, batches: list[Batch]) -> mx.array:
        return grpo.step_norms(batches)

    def loss(self, model: nn.Module, inputs, positions, targets, mask, adv, old, ref, norms) -> Any:
        logp, entropy = completion_logps(model, inputs, positions, targets, temperature=self.cfg.temp)
        return grpo.grpo_loss(logp, old, ref, adv, mask, self.spec, norms, entropy)

    def value(self, out: Any) -> mx.array:
        return out[1]

    def scalar(self, value: mx.array) -> mx.array:
        return value[0]

    def step_fields(self, out: Any) -> tuple[float, dict[str, Any]]:
        fields = dict(self.pending)
        fields.update(zip(grpo.STATS[1:], out[1:]))
        if not self.cfg.beta:
            fields.pop("kl")
        return out[0], fields

    # -- evaluation: the mean reward of greedy completions of the validation prompts
    def evaluate(self, stepper, stream: BatchStream, n_batches: int) -> tuple[float, int, dict[str, Any]]:
        s, c = self.setup, self.cfg
        n = stream.batches_per_epoch if n_batches < 0 else min(n_batches, stream.batches_per_epoch)
        prompts = [p for i in range(n) for p in stream.prompts(i)]
        rows = max(1, c.batch_size * c.group_size)
        fields = grpo.greedy_rewards(s.model, s.tokenizer, prompts, self.rewards, c.max_completion_tokens, rows)
        if c.eval_generations:
            fields.update(grpo.sampled_rewards(s.model, s.tokenizer, prompts, self.rewards, c.max_completion_tokens,
                                               rows, self.sampling, c.eval_generations,
                                               grpo.eval_seed(c.seed)))
        return -fields["reward"], len(prompts), fields

    # -- the memory estimate: batch_size x group_size rows of prompt + completion, as
    # `grpo.completion_batch` lays them out; the loss reads the completions' logits only
    def memory_rows(self, batch_size: int, seq_len: int) -> tuple[int, int]:
        width = self._longest_prompt(seq_len) + self.cfg.max_completion_tokens - 1
        return batch_size * self.cfg.group_size, -(-width // PAD_MULTIPLE) * PAD_MULTIPLE

    def memory_loss_tokens(self, rows: int, width: int, fused: bool) -> int:
        return rows * self.cfg.max_completion_tokens if fused else rows * width

    def memory_decode(self, batch_size: int, grad_accum: int) -> tuple[int, int, int] | None:
        # a step's micro-batches are one generation (`grpo.collect`)
        c = self.cfg
        return batch_size * c.group_size * grad_accum, self._longest_prompt(c.seq_len), c.max_completion_tokens

    def memory_measure(self, raw: RawSplits, tokenizer: Callable[[], Any]) -> bool:
        # the splits load_dataset tokenizes (a valid split held out of train is in train)
        if self.longest_prompt:
            return False
        tok = tokenizer()
        for records, name in ((raw.train, raw.train_path), (raw.valid or [], "valid")):
            self.tokenize(records, tok, self.cfg.seq_len, name=name)
        return True

    def _longest_prompt(self, seq_len: int) -> int:
        # known once the prompts are tokenized (or measured); before that seq_len bounds it
        return self.longest_prompt or seq_len

    def memory_extra(self, trainable_bytes: int) -> int:
        return trainable_bytes if self.cfg.beta and not self.cfg.adapters else 0


OBJECTIVE_TYPES: dict[str, type[Objective]] = {"sft": SFT, "dpo": DPO, "orpo": ORPO, "grpo": GRPO}


def make_objective(cfg: TrainConfig) -> Objective:
    """The objective cfg names, its settings checked (UserError) and defaults resolved."""
    return OBJECTIVE_TYPES[cfg.objective](cfg)
