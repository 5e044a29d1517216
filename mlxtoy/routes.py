"""Which implementation runs each kind of CPU work on this machine, chosen by timing them here.

A float32 product of many rows can run on the kernels' GEMM (AVX-512, or AVX2 and FMA) or on
the loaded BLAS (MKL, OpenBLAS: MLX's matmul); attention over many positions on the kernels'
block attention or on MLX's GEMMs around the kernels' softmax. Which is faster depends on the
CPU (full-width AVX-512, AVX-512 run as two halves, AVX2 only, Intel's cores with MKL), the
BLAS, the shapes and the cores: no rule about a CPU family predicts it. So the first time a
shape class is met (or in `mlxtoy doctor --calibrate`) each candidate route runs on it here:
the routes whose values disagree with the reference route's are set aside, the others are
timed, and the fastest is used from then on (`doctor --calibrate` takes a second look at the
kept ones, each route rated by its better look). The choice is kept in the cache, keyed by what it
depends on (CPU model, cores, mlxtoy, MLX, the BLAS and the kernels' build); a cache made under
another key, or unreadable, is ignored.

No MLX import: the candidates are callables handed in by the code that owns them (fastmath).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from mlxtoy import fsutil

ROUTES_FILE = "routes.json"  # in the cache folder (settings.cache_dir)
# A route must beat the reference route by this much to be taken over it: timings on a busy
# machine swing by a few percent, and the reference (the BLAS, MLX's own op) is the safe choice.
MARGIN = 0.03
# What a candidate's values may differ from the reference route's, relative to their largest
# magnitude: float32 sums in another order differ by ~1e-6 relative; a wrong result by far more.
PARITY_RTOL = 1e-4

# A route's timed runs go on until they have taken this long together, at most LOOKS of them,
# in each of ROUNDS rounds taken in turn with the other routes' (its time: the fastest run).
LOOK_SECONDS = 0.005
LOOKS = 8
ROUNDS = 2
LONG_RUN_SECONDS = 0.02  # a route whose runs take longer is timed in the first round only
# Before a process's first measurement the routes run in turn, untimed, until this long has
# passed: a fresh process's first ~50 ms of products run slow (on the Zen 4, OpenBLAS at 11-48
# and the kernels' GEMM at 62-80 of their ~190 GFLOP/s, then both at their rate for good), which
# chose a route for good on one slow round.
WARM_UP_SECONDS = 0.1

Outputs = Sequence[np.ndarray]
Candidate = Callable[[], Outputs]  # runs the work once (evaluated), returns its values


@dataclass
class Choice:
    """What was measured for one shape class: the route taken, each candidate's rate in GFLOP/s
    (None where its values disagreed with the reference's), and what measuring cost."""

    route: str
    gflops: dict[str, float | None]
    seconds: float

    def to_dict(self) -> dict:
        return {"route": self.route, "gflops": self.gflops, "seconds": round(self.seconds, 4)}

    @staticmethod
    def from_dict(d: dict) -> "Choice":
        gflops = {str(k): (None if v is None else float(v)) for k, v in d["gflops"].items()}
        route = str(d["route"])
        if route not in gflops or gflops[route] is None:
            raise ValueError(f"route {route!r} has no measured rate")
        return Choice(route, gflops, float(d["seconds"]))


def timed(run: Callable[[], Outputs]) -> tuple[Outputs, float]:
    start = time.perf_counter()
    values = run()
    return values, time.perf_counter() - start


def second_look(name: str, run: Callable[[], Outputs], first: float, best: float) -> float:
    """A route's time: the fastest of its first run (which also gave its values) and the runs
    after it. The first alone is no measure: it pays for its buffers' first page faults and for
    waking the threads, several times a run's own time on a large problem. A short run is timed
    again until the runs have taken LOOK_SECONDS together (LOOKS at most): any one of them may be
    the one a wake-up of the BLAS's sleeping threads or a burst of other work fell on (OpenBLAS's
    256 x 576 x 192 product once timed at 7 of its 135 GFLOP/s, and lost its shape to a slower
    route)."""
    fastest_run, spent = first, 0.0
    for _ in range(LOOKS):
        seconds = timed(run)[1]
        fastest_run, spent = min(fastest_run, seconds), spent + seconds
        if spent >= LOOK_SECONDS:
            break
    return fastest_run


def agrees(values: Outputs, reference: Outputs, rtol: float = PARITY_RTOL) -> bool:
    """Whether every output matches the reference's within rtol of the reference's largest
    magnitude (and has its shape, and no NaN where the reference has none)."""
    if len(values) != len(reference):
        return False
    for v, r in zip(values, reference):
        v, r = np.asarray(v, dtype=np.float64), np.asarray(r, dtype=np.float64)
        if v.shape != r.shape:
            return False
        scale = max(float(np.max(np.abs(r))) if r.size else 0.0, 1e-30)
        if not np.all(np.isfinite(v) == np.isfinite(r)):
            return False
        finite = np.isfinite(r)
        if np.any(np.abs(v[finite] - r[finite]) > rtol * scale):
            return False
    return True


def fastest(names: list[str], rates: dict[str, float | None]) -> str:
    """The route to take by these rates (GFLOP/s; None: its values were wrong): the reference
    (the first name) unless another beats it by MARGIN."""
    best = names[0]
    for name in names[1:]:
        if rates.get(name) is not None and rates[name] > (rates[best] or 0.0) * (1 + MARGIN):
            best = name
    return best


@dataclass
class RouteTable:
    """The measured choices of this machine, by kind of work and shape class, and where they
    are kept. `time_route(name, run, first, best)` times one candidate in one round, given its
    time so far (its first run's, then its earlier rounds') and the best so far (tests inject
    timings through it);
    `log` hears one line per measurement (its cost included)."""

    path: str | None
    fingerprint: dict[str, str]
    time_route: Callable[[str, Callable[[], Outputs], float, float], float] = second_look
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)
    choices: dict[str, Choice] = field(default_factory=dict)
    measuring_seconds: float = 0.0  # what this process spent measuring
    warmed_up: bool = False  # whether this process has measured (WARM_UP_SECONDS)
    # `mlxtoy doctor --calibrate`: a kept choice is measured again (once a process), each route
    # rated by its better look (other work on the machine only ever slows a look), so a choice
    # made while the machine was busy is not kept for good. Only there: a training run and its
    # resume must take the same routes, whose sums differ in order.
    look_again: bool = False
    looked_again: set[str] = field(default_factory=set)

    @staticmethod
    def key(kind: str, shape: Sequence[int | str]) -> str:
        return kind + ":" + "x".join(str(s) for s in shape)

    def load(self) -> str | None:
        """Read the kept choices; None where they were read, else why none were (no file, another
        machine or version: a stale key, an unreadable file). Never raises."""
        if not self.path or not os.path.exists(self.path):
            return "no measurements kept yet"
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            if data.get("fingerprint") != self.fingerprint:
                return "measured under another CPU, thread count or version: measuring again"
            self.choices = {k: Choice.from_dict(v) for k, v in data["choices"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            self.choices = {}
            return f"{self.path} is unreadable ({type(e).__name__}): measuring again"
        return None

    def save(self) -> None:
        if not self.path:
            return
        data = {"fingerprint": self.fingerprint, "choices": {k: c.to_dict() for k, c in sorted(self.choices.items())}}
        try:
            fsutil.write_text_atomic(self.path, json.dumps(data, indent=1) + "\n")
        except OSError as e:  # a read-only cache costs a measurement per process, nothing more
            self.log(f"warning: could not keep the measured routes in {self.path} ({e})")

    def chosen(self, kind: str, shape: Sequence[int | str]) -> Choice | None:
        return self.choices.get(self.key(kind, shape))

    def due(self, kind: str, shape: Sequence[int | str]) -> bool:
        """Whether this shape class is to be measured now: never measured here, or its second
        look due (`look_again`, not yet taken in this process)."""
        key = self.key(kind, shape)
        return key not in self.choices or (self.look_again and key not in self.looked_again)

    def kept_route(self, kind: str, shape: Sequence[int | str], names: Sequence[str]) -> str | None:
        """The kept choice among the routes `names` (the first the reference): its route where
        those were the routes measured; the fastest of them by the kept rates where more were
        (a switch turned one off); None where one of them was not measured (a route added
        since), so it is measured again, or where its second look is due."""
        kept = self.chosen(kind, shape)
        if kept is None or not set(names) <= set(kept.gflops) or self.due(kind, shape):
            return None
        return kept.route if set(names) == set(kept.gflops) else fastest(list(names), kept.gflops)

    def choose(self, kind: str, shape: Sequence[int | str], candidates: dict[str, Candidate], flops: float,
               what: str, rtol: float = PARITY_RTOL) -> str:
        """The route for this shape class: the kept choice, else measured now (`look_again`: measured
        again, each route rated by its better look). The first candidate is the reference: the
        others must give its values (`agrees`, within rtol) to be timed, and beat it by MARGIN
        to be taken."""
        names = list(candidates)
        key = self.key(kind, shape)
        kept = self.kept_route(kind, shape, names)
        if kept is not None:
            return kept
        earlier = self.choices.get(key)  # (a second look: the first one's rates)
        if earlier is None or not set(names) <= set(earlier.gflops):
            earlier = None
        self.looked_again.add(key)
        start = time.perf_counter()
        # every route runs once (its values, and a first time), then each is timed again in
        # rounds, in turn: interleaved, a burst of other work on the machine weighs on every
        # route alike, and the fastest of a route's rounds is one the burst missed
        firsts: dict[str, float] = {}
        reference: Outputs = []
        for name in names:
            values, firsts[name] = timed(candidates[name])
            if name == names[0]:
                reference = values
            elif not agrees(values, reference, rtol):
                firsts[name] = float("nan")
        timed_names = [n for n in names if firsts[n] == firsts[n]]  # (NaN: its values disagreed)
        if not self.warmed_up:
            self.warmed_up = True
            while time.perf_counter() - start < WARM_UP_SECONDS:
                for name in timed_names:
                    candidates[name]()
        seconds = dict(firsts)
        best = float("inf")
        for round_ in range(ROUNDS):
            for name in timed_names:
                if round_ and seconds[name] > LONG_RUN_SECONDS:  # a burst is a small part of a long run
                    continue
                # (the timer takes the fastest of the time so far and its own runs)
                seconds[name] = max(self.time_route(name, candidates[name], seconds[name], best), 1e-12)
                best = min(best, seconds[name])
        rates: dict[str, float | None] = {n: flops / seconds[n] / 1e9 if n in timed_names else None for n in names}
        if earlier is not None:  # a second look: each route's better one (wrong values in either: set aside)
            rates = {n: None if r is None or earlier.gflops[n] is None else max(r, earlier.gflops[n])
                     for n, r in rates.items()}
        best = fastest(names, rates)
        spent = time.perf_counter() - start
        self.measuring_seconds += spent
        choice = Choice(best, rates, spent)
        self.choices[key] = choice
        self.save()
        shown = ", ".join(f"{n} {'wrong values' if r is None else f'{r:.0f}'}" for n, r in rates.items())
        looks = f"; the better of two looks, was {earlier.route}" if earlier is not None else ""
        self.log(f"routes: {what}: {best} (GFLOP/s: {shown}; measured in {spent:.2f} s{looks})")
        return best
