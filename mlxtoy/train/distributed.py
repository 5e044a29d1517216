"""Data-parallel training over `mx.distributed` (several processes, one or many machines).

Launch every rank with MLX's launcher (it sets MLX_RANK / MLX_HOSTFILE; any backend MLX
offers works, the ring backend over TCP is the one tested here):

    mlx.launch --backend ring -n 2 -- -m mlxtoy train --model M --data D --out RUN ...
    mlx.launch --hostfile hosts.json -- -m mlxtoy train ...      # several machines

How the work is split, and why the result equals one process with the same global batch:
- Every rank builds the same global batch (batches are a pure function of seed and position)
  and keeps rows [r*B/n, (r+1)*B/n): the union of the shards is exactly the one-process batch.
- The loss is a token-weighted sum divided by the number of trained tokens of the *global*
  batch (every rank knows it: it built the whole batch), so each rank's gradient is its share
  of the global mean, and the all-reduced sum is the one-process gradient. Clipping and the
  AdamW update then run on identical gradients, so every rank keeps identical weights.
- One all-reduce per step carries the gradients, the loss and the control flags (stop, eval,
  sample, checkpoint requests), so every rank takes every decision at the same step.
- Rank 0 owns the run directory: config.yaml (with `world_size`), metrics, checkpoints and the
  final result. Other ranks write nothing; on resume they receive the checkpoint (weights,
  optimizer state, RNG key, data position) from rank 0, so any world size that divides the
  batch can continue any run.
- Failure: a rank that dies closes its sockets and the others get an error at the next
  collective; a rank that hangs is caught by a watchdog thread that ends the process when a
  collective waits longer than `timeout` seconds. Either way the job stops with a one-line
  message; checkpoints are written atomically, so the last complete one stays loadable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.events import Command
from mlxtoy.rundir import RunDir
from mlxtoy.train.checkpoint import flat_optimizer_state, restore_optimizer_state
from mlxtoy.train.control import Control
from mlxtoy.train.data import Batch
from mlxtoy.train.job import Prepared, prepare

DEFAULT_TIMEOUT = 300.0  # seconds a collective may wait for the other ranks
_LAUNCH_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_BUCKET = 1 << 24  # elements per all-reduce (64 MB of float32): bounded extra memory
_FLAGS = ("stop", "interrupted", Command.EVAL, Command.SAMPLE, Command.CHECKPOINT)

_ACTIVE: "Distributed | None" = None


class DistributedError(RuntimeError):
    """A rank failed or a collective timed out: the job cannot go on."""


def launched() -> bool:
    """True when this process was started by mlx.launch / mpirun."""
    return any(os.environ.get(k) for k in _LAUNCH_ENV)


def active() -> "Distributed | None":
    """The data-parallel context set up by `setup` (None: a single process)."""
    return _ACTIVE


def is_main() -> bool:
    return _ACTIVE is None or _ACTIVE.is_main


def setup(requested: bool = False, timeout: float | None = None) -> "Distributed | None":
    """Join the process group when launched by mlx.launch (or when `requested`).

    Returns None when there is a single process (the plain single-process path)."""
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    if not (requested or launched()):
        return None
    try:
        group = mx.distributed.init(strict=launched())
    except Exception as e:  # noqa: BLE001 -- MLX raises RuntimeError/ValueError variously
        raise UserError(f"cannot join the distributed group ({e}); start every rank with "
                        f"mlx.launch (see the README, 'Training on several machines')") from None
    if group.size() <= 1:
        if requested:
            print("warning: --distributed but only one process (start the ranks with "
                  "mlx.launch -n N ...): training in this process alone", file=sys.stderr)
        return None
    _ACTIVE = Distributed(group, DEFAULT_TIMEOUT if timeout is None else timeout)
    return _ACTIVE


# ---------------------------------------------------------------------------------------------
# The run directory as seen by ranks > 0: same path, nothing written
# ---------------------------------------------------------------------------------------------


class PeerRunDir(RunDir):
    """Rank > 0: rank 0 owns the run directory; this one reads its checkpoints list (for the
    messages) but writes nothing (the writers check `read_only`)."""

    read_only = True

    def check_fresh(self) -> None:
        pass

    def clean_partial(self) -> None:
        pass

    def checkpoints(self) -> list[tuple[int, str]]:
        return []


# ---------------------------------------------------------------------------------------------
# The group, collectives with a watchdog
# ---------------------------------------------------------------------------------------------


class Distributed:
    def __init__(self, group, timeout: float):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.is_main = self.rank == 0
        self.timeout = timeout
        self.run: RunDir | None = None  # set by `wrap`: named in failure messages
        self.allreduce_seconds: list[float] = []  # per step (bench)
        self._deadline: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        threading.Thread(target=self._watchdog, name="mlxtoy-dist-watchdog", daemon=True).start()

    # ---- failure handling
    def _last_checkpoint(self) -> str:
        try:
            if self.run is not None and self.is_main:
                return self.run.latest_checkpoint() or "none"
        except OSError:
            pass
        return "kept by rank 0" if self.run is not None else "none"

    def _watchdog(self) -> None:
        # A collective whose peer hangs (alive, sockets open) never returns, and the main
        # thread is inside C++ where no Python exception can reach it: leave from here.
        while True:
            time.sleep(0.2)
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if late:
                print(f"error: distributed training: rank {self.rank} of {self.size} waited more "
                      f"than {self.timeout:g}s for the other ranks in {what} (a rank is hung or "
                      f"unreachable; raise the limit with --dist-timeout); stopping. Last "
                      f"checkpoint: {self._last_checkpoint()}", file=sys.stderr, flush=True)
                os._exit(1)

    @contextlib.contextmanager
    def watch(self, what: str):
        """Bound the time the enclosed collective may take; turn a lost peer into one error."""
        with self._lock:
            self._deadline, self._what = time.monotonic() + self.timeout, what
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, DistributedError):
                raise
            raise DistributedError(
                f"distributed training: rank {self.rank} of {self.size} lost contact with the "
                f"other ranks in {what} ({e}); a rank failed or was killed. Last checkpoint: "
                f"{self._last_checkpoint()}") from None
        finally:
            with self._lock:
                self._deadline = None

    def all_sum(self, arrays: list[mx.array], what: str) -> list[mx.array]:
        with self.watch(what):
            out = [mx.distributed.all_sum(a, group=self.group) for a in arrays]
            mx.eval(out)
        return out

    def broadcast(self, arrays: dict[str, mx.array], what: str) -> dict[str, mx.array]:
        """Rank 0's values on every rank (a sum where the other ranks contribute zeros)."""
        names = sorted(arrays)
        send = [arrays[k] if self.is_main else mx.zeros_like(arrays[k]) for k in names]
        return dict(zip(names, self.all_sum(send, what)))

    def broadcast_json(self, obj: Any, what: str) -> Any:
        data = json.dumps(obj).encode() if self.is_main else b""
        (n,) = self.all_sum([mx.array([len(data)], dtype=mx.int32)], what)
        buf = np.zeros(int(n.item()), dtype=np.uint8)
        if self.is_main:
            buf[:] = np.frombuffer(data, dtype=np.uint8)
        (out,) = self.all_sum([mx.array(buf)], what)
        return json.loads(bytes(np.array(out)).decode())

    def all_ok(self, ok: bool, what: str) -> list[int]:
        """Ranks that were not ok (every rank calls this)."""
        (flags,) = self.all_sum([mx.array(np.eye(self.size, dtype=np.int32)[self.rank] * (0 if ok else 1))], what)
        return [i for i, f in enumerate(flags.tolist()) if f]

    # ---- data
    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.size:
            raise UserError(f"--batch-size {batch_size} is not divisible by the {self.size} ranks "
                            f"(each rank trains batch_size / ranks rows of every global batch)")

    def shard(self, batch: Batch) -> Batch:
        """This rank's rows of a global batch (rows may be none: a short last eval batch)."""
        n = batch.inputs.shape[0]
        lo, hi = self.rank * n // self.size, (self.rank + 1) * n // self.size
        w = batch.weights[lo:hi]
        seg = batch.segments[lo:hi]
        # preference pairs: `seq`, `ref` and `pairs` keep the batch's numbering of its pairs,
        # so a shard (whole pairs: a pair never spans rows, see mlxtoy.train.pairs) knows which;
        # sampled completions (grpo): each row's advantage and log-probs go with it (the batch
        # counts prompts, a multiple of the ranks: each rank takes whole groups)
        rows = lambda a: a[lo:hi] if a is not None else None  # noqa: E731
        return dataclasses.replace(batch, inputs=batch.inputs[lo:hi], targets=batch.targets[lo:hi],
                                   weights=w, segments=seg, n_tokens=int((seg >= 0).sum()),
                                   n_loss=int(w.sum()), seq=rows(batch.seq), advantages=rows(batch.advantages),
                                   positions=rows(batch.positions), old_logps=rows(batch.old_logps),
                                   ref_logps=rows(batch.ref_logps))

    # ---- setup
    def prepare(self, build: Callable[[], tuple[TrainConfig, bool]]) -> Prepared:
        """The job's prepare for every rank: rank 0 resolves the config (flags, --config, or
        the run's own config on --resume) and owns the run directory; the others receive the
        config and load the same model and data (the paths must exist on every machine)."""
        err = None
        payload: dict[str, Any] = {}
        if self.is_main:
            try:
                cfg, resume = build()
                self.check_batch(cfg.batch_size)
                payload = {"config": cfg.to_dict(), "resume": resume}
            except UserError as e:
                err = e
                payload = {"error": str(e)}
        payload = self.broadcast_json(payload, "sharing the configuration")
        if err is not None:
            raise err
        if "error" in payload:
            raise DistributedError(f"rank 0 refused the configuration: {payload['error']}")
        cfg = TrainConfig.from_dict(payload["config"], source="rank 0's configuration")
        resume = bool(payload["resume"])
        p, err = None, None
        try:
            if self.is_main:
                p = prepare(cfg, resume)
                p.facts.world_size = self.size
                p.run.write_config(p.cfg, p.facts)
            else:  # rank 0's checkpoint reaches this rank in sync_start
                p = prepare(cfg, resume, run=PeerRunDir(cfg.out))
                p.resume_from = None
        except UserError as e:
            err = e
        bad = self.all_ok(err is None, "setting up the ranks")
        if err is not None:
            raise UserError(f"rank {self.rank}: {err}")
        if bad:
            raise DistributedError(f"rank(s) {', '.join(map(str, bad))} failed to set up (see their "
                                   f"error above); stopping")
        return p

    def sync_start(self, model, optimizer, resumed: bool,
                   counters: tuple[int, int, float, int]) -> tuple[int, int, float, int]:
        """Give every rank rank 0's starting point: on resume its checkpoint (trainable
        weights, optimizer state, RNG key, data position); always check that the weights agree."""
        step, position, elapsed, tokens_seen = counters
        key = [int(v) for v in mx.random.state[0].tolist()]
        head = self.broadcast_json({"resumed": resumed, "step": step, "position": position,
                                    "elapsed": elapsed, "tokens_seen": tokens_seen, "rng": key},
                                   "sharing the starting point")
        if head["resumed"]:
            trainable = self.broadcast(dict(tree_flatten(model.trainable_parameters())),
                                       "sharing the checkpoint weights")
            opt = self.broadcast(flat_optimizer_state(optimizer), "sharing the optimizer state")
            if not self.is_main:
                model.load_weights(list(trainable.items()), strict=False)
                restore_optimizer_state(optimizer, opt, "rank 0's checkpoint")
            hi, lo = head["rng"]
            mx.random.seed((hi << 32) | lo)
        # every weight (frozen base included) must be the same everywhere: same files, same code
        sums = mx.stack([v.astype(mx.float32).sum() for _, v in sorted(tree_flatten(model.parameters()))])
        with self.watch("checking the weights"):
            every = mx.distributed.all_gather(sums[None], group=self.group)
            mx.eval(every)
        every = np.array(every)
        if not (every == every[0]).all():
            bad = [r for r in range(self.size) if not (every[r] == every[0]).all()]
            raise DistributedError(f"rank(s) {bad} hold different weights from rank 0 (different "
                                   f"model files or mlxtoy versions on the machines?)")
        return head["step"], head["position"], head["elapsed"], head["tokens_seen"]

    def attach(self, control: Control, run: RunDir) -> tuple["GradientAllReduce", "AgreedControl"]:
        """The loop's hooks: a control whose decisions all ranks share, and the reducer that
        shards batches and all-reduces gradients (carrying the control flags with them)."""
        self.run = run
        agreed = AgreedControl(control)
        return GradientAllReduce(self, agreed), agreed


# ---------------------------------------------------------------------------------------------
# The step and the control, across ranks
# ---------------------------------------------------------------------------------------------


class AgreedControl:
    """A Control whose decisions (stop, eval/sample/checkpoint requests) are taken by all
    ranks at the same step: local requests travel with the step's all-reduce."""

    def __init__(self, inner: Control):
        self.inner = inner
        self.stop_at = inner.stop_at
        self._stop: str | None = None
        self._taken: set[Command] = set()

    def wait_while_paused(self, step: int) -> None:
        self.inner.wait_while_paused(step)

    def stop(self, reason: str = "stopped") -> None:
        self.inner.stop(reason)

    @property
    def stop_reason(self) -> str | None:
        return self._stop

    def take(self, what: Command) -> bool:
        if what in self._taken:
            self._taken.discard(what)
            return True
        return False

    def local_flags(self) -> mx.array:
        reason = self.inner.stop_reason
        f = [reason is not None, reason == "interrupted"] + [self.inner.take(w) for w in _FLAGS[2:]]
        return mx.array([float(v) for v in f], dtype=mx.float32)

    def agree(self, flags: list[float]) -> None:
        got = dict(zip(_FLAGS, flags))
        if got["stop"] > 0 and self._stop is None:
            self._stop = "interrupted" if got["interrupted"] > 0 else (self.inner.stop_reason or "stopped")
            self.inner.stop(self._stop)
        self._taken |= {w for w in _FLAGS[2:] if got[w] > 0}


class GradientAllReduce:
    """The Stepper's reducer across ranks: this rank's shard of each global batch, one
    all-reduce of the gradients (with the loss and the control flags), the evaluation sums."""

    def __init__(self, dist: Distributed, control: AgreedControl):
        self.dist, self.control = dist, control
        self.n_steps = 0

    def shard(self, batch: Batch) -> Batch:
        return self.dist.shard(batch)

    def reduce(self, loss: mx.array, grads: Any, extremes: dict[int, str] | None = None) -> tuple[mx.array, Any]:
        """loss: the step's loss, or a vector of statistics (loss first), each summed over the
        ranks except `extremes`: {index: "min" | "max"}, the least or the largest rank's value."""
        self.n_steps += 1
        flat = tree_flatten(grads)
        n_out = loss.size
        stats = loss.reshape(-1).astype(mx.float32)
        # each extreme travels in a slot per rank (zeros elsewhere): the sum gathers them all
        slots = [mx.zeros((self.dist.size,), mx.float32).at[self.dist.rank].add(stats[i]) for i in extremes or {}]
        tail = mx.concatenate([stats, *slots, self.control.local_flags()])
        buckets = _buckets([v for _, v in flat] + [tail])
        t0 = time.perf_counter()
        reduced = self.dist.all_sum([mx.concatenate([a.reshape(-1).astype(mx.float32) for a in bk])
                                     for bk in buckets],
                                    f"the gradient all-reduce (step {self.n_steps} of this process)")
        self.dist.allreduce_seconds.append(time.perf_counter() - t0)
        values = []
        for bk, red in zip(buckets, reduced):
            off = 0
            for a in bk:
                values.append(red[off: off + a.size].reshape(a.shape).astype(a.dtype))
                off += a.size
        tail = values.pop()
        n_slots = len(slots) * self.dist.size
        self.control.agree(tail[n_out + n_slots:].tolist())
        out = tail[:n_out]
        for j, (i, how) in enumerate((extremes or {}).items()):
            ranks = tail[n_out + j * self.dist.size: n_out + (j + 1) * self.dist.size]
            out[i] = ranks.min() if how == "min" else ranks.max()
        return out.reshape(loss.shape), tree_unflatten([(k, v) for (k, _), v in zip(flat, values)])

    def reduce_eval(self, total: float, count: int) -> tuple[float, int]:
        """The one-process mean's parts: sums of token losses and token counts over all ranks."""
        hi = np.float32(total)
        lo = np.float32(total - float(hi))  # float32 all-reduce without losing the float64 sum
        sums, counts = self.dist.all_sum([mx.array([float(hi), float(lo)], dtype=mx.float32),
                                          mx.array([count], dtype=mx.int32)], "evaluation")
        return float(np.float64(sums[0].item()) + np.float64(sums[1].item())), int(counts[0].item())


def _buckets(arrays: list[mx.array]) -> list[list[mx.array]]:
    out: list[list[mx.array]] = [[]]
    n = 0
    for a in arrays:
        if out[-1] and n + a.size > _BUCKET:
            out.append([])
            n = 0
        out[-1].append(a)
        n += a.size
    return out
