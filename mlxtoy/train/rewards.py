"""Reward functions for GRPO: the built-ins and a user's own, parsed from `--reward`.

`--reward NAME[,NAME...]` (weights from `--reward-weights`, default 1 each):

    exact          1 if the stripped completion equals the stripped answer, else 0
    contains       1 if the completion contains the stripped answer, else 0
    regex:PATTERN  1 if PATTERN matches somewhere in the completion (re.search), else 0
    numeric        1 if the completion's last number equals the answer's, else 0
                   (None, "not applicable", when the answer holds no number)
    think-format   1 for "<think>...</think>" followed by an answer, else 0
    length:N       0 up to N completion tokens, then -(tokens - N) / N
    overlong:MAX,CACHE  DAPO's soft overlong punishment (TRL's get_soft_overlong_punishment):
                   0 up to MAX - CACHE tokens, then falling linearly to -1 at MAX, -1 beyond
    FILE.py:FUNC   a user's function, called with the keyword arguments prompt (the row's
                   prompt: a string or its messages), completion (text), answer, and any other
                   column of the row that its signature names (all of them with **kwargs);
                   it returns a number, or None for "not applicable"

A user's file is loaded once, when the run starts, and each function is called on the first
training row before the model loads (signature, columns, return type). Every call is guarded
(`guarded_call`): what it prints goes to stderr (stdout carries only the product); an exception,
or `sys.exit()`, inside it is one UserError naming the file, the function and the row (the CLI:
one `error:` line, exit 2); a call still running after `--reward-timeout` seconds is one too;
a KeyboardInterrupt inside it is an interrupt, as Ctrl-C is. A reward that is None counts as 0
in the weighted sum (as TRL's nansum) and is left out of its mean; a NaN is taken as None. A
completion whose every reward is None is unscorable (`RewardSet.combine`: NaN): GRPO leaves it
out of its group's baseline and gives it advantage 0, as TRL >= 1.6 does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import os
import queue
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from mlxtoy.errors import UserError

BUILTINS = ("exact", "contains", "regex:PATTERN", "numeric", "think-format", "length:N", "overlong:MAX,CACHE")
OVERLONG_NAME = "soft_overlong_punishment_reward"  # TRL's name, so the metric keys match its
STANDARD_ARGS = ("prompt", "completion", "answer")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
THINK = re.compile(r"\s*<think>.*?</think>\s*\S.*", re.DOTALL)
REWARD_THREAD = "mlxtoy-reward"  # the threads users' rewards run in (their prints go to stderr)

# fn(prompt object, completion text, completion tokens) -> float | None; the prompt object has
# .prompt, .answer, .row and .where (mlxtoy.train.grpo.Prompt)
RewardFn = Callable[[Any, str, int], "float | None"]
_MODULES: dict[tuple[str, int], Any] = {}  # user files loaded, by (path, modification time)


def last_number(text: str) -> float | None:
    found = NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", text))
    return float(found[-1]) if found else None


def _exact(p, completion: str, n: int) -> float:
    return float(completion.strip() == str(p.answer).strip())


def _contains(p, completion: str, n: int) -> float:
    return float(str(p.answer).strip() in completion)


def _numeric(p, completion: str, n: int) -> float | None:
    want = last_number(str(p.answer))
    if want is None:
        return None
    got = last_number(completion)
    return float(got is not None and abs(got - want) <= 1e-9 * max(1.0, abs(want)))


def _think_format(p, completion: str, n: int) -> float:
    return float(THINK.fullmatch(completion) is not None)


def _regex(pattern: str) -> RewardFn:
    try:
        rx = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise UserError(f"--reward regex:{pattern}: not a valid regular expression ({e})") from None
    return lambda p, completion, n: float(rx.search(completion) is not None)


def _length(arg: str) -> RewardFn:
    try:
        limit = int(arg)
    except ValueError:
        limit = 0
    if limit <= 0:
        raise UserError(f"--reward length:{arg}: N must be a whole number of tokens > 0")
    return lambda p, completion, n: 0.0 if n <= limit else -(n - limit) / limit


class RewardStdout:
    """sys.stdout while users' rewards run: what a reward's thread prints goes to stderr, every
    other thread's output to the real stdout (which carries only the product)."""

    def __init__(self, real):
        self.real = real

    def _target(self):
        return sys.stderr if threading.current_thread().name == REWARD_THREAD else self.real

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class RewardTimeout(Exception):
    pass


class RewardWorker:
    """A daemon thread that runs reward calls one at a time (a thread per call cost ~1 ms)."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self.serve, name=REWARD_THREAD, daemon=True).start()

    def serve(self) -> None:
        while True:
            fn, kwargs, box, done = self.jobs.get()
            try:
                box["value"] = fn(**kwargs)
            except BaseException as e:  # SystemExit and KeyboardInterrupt too: the caller decides
                box["error"] = e
            done.set()


_WORKER: list[RewardWorker] = []  # the worker in use; one left running a call is dropped


def guarded_call(fn: Callable[..., Any], kwargs: dict[str, Any], timeout: float | None) -> Any:
    """fn(**kwargs) in a worker thread, its prints sent to stderr: its value, or the exception
    it raised (SystemExit included) raised here; RewardTimeout when it is still running after
    `timeout` seconds (None: no limit). Ctrl-C while it runs raises KeyboardInterrupt here at
    once. A worker left running a call (timeout, Ctrl-C) is a daemon thread: it cannot keep the
    process alive, what it prints later still goes to stderr, and the next call gets a new one."""
    if not _WORKER:
        _WORKER.append(RewardWorker())
    box: dict[str, Any] = {}
    done = threading.Event()
    real = sys.stdout
    if not isinstance(real, RewardStdout):
        sys.stdout = RewardStdout(real)
    _WORKER[0].jobs.put((fn, kwargs, box, done))
    try:
        finished = done.wait(timeout)  # a signal handler's KeyboardInterrupt interrupts this wait
    except BaseException:
        _WORKER.clear()
        raise
    if not finished:
        _WORKER.clear()
        raise RewardTimeout
    sys.stdout = real  # (left routed when a call is abandoned: it may print later)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _overlong(arg: str) -> RewardFn:
    """DAPO's soft overlong punishment (its Eq. 13), over the completion's tokens."""
    try:
        longest, cache = (int(x) for x in arg.split(","))
    except ValueError:
        longest = cache = -1
    if longest <= 0 or not 0 <= cache <= longest:
        raise UserError(f"--reward overlong:{arg}: want MAX,CACHE, whole numbers of tokens with 0 <= CACHE <= MAX")
    free = longest - cache

    def reward(p, completion: str, n: int) -> float:
        return 0.0 if n <= free else (free - n) / cache if n <= longest else -1.0

    return reward


def _load_user(spec: str, timeout: float | None = None) -> tuple[str, RewardFn]:
    """FILE.py:FUNCTION -> (its name, a RewardFn calling it with the keywords it names)."""
    path, _, func = spec.rpartition(":")
    if not os.path.isfile(path):
        raise UserError(f"--reward {spec}: no such file {path}")
    module = _load_module(path)
    fn = getattr(module, func, None)
    if not callable(fn):
        raise UserError(f"--reward {spec}: {path} has no function {func!r}")
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                          inspect.Parameter.KEYWORD_ONLY)]
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}

    def call(p, completion: str, n: int) -> float | None:
        given = {**p.row, "prompt": p.prompt, "completion": completion, "answer": p.answer}
        missing = sorted(k for k in required if k not in given)
        if missing:
            raise UserError(f"{path}:{func}: needs column {missing[0]!r}, which {p.where} does not have "
                            f"(it has {', '.join(sorted(p.row))})")
        kwargs = given if takes_all else {k: v for k, v in given.items() if k in named}
        try:
            value = guarded_call(fn, kwargs, timeout)
        except RewardTimeout:
            raise UserError(f"{path}:{func}: still running after {timeout:g} s (--reward-timeout) on "
                            f"{p.where}") from None
        except SystemExit as e:
            code = "" if e.code is None else repr(e.code)
            raise UserError(f"{path}:{func}: called sys.exit({code}) on {p.where} (a reward returns a "
                            f"number or None)") from None
        except Exception as e:
            raise UserError(f"{path}:{func}: raised {type(e).__name__}: {_one_line(e)} (on {p.where})") from None
        if value is None:
            return None
        if isinstance(value, (bool, int, float, np.number)) and math.isfinite(float(value)):
            return float(value)
        if isinstance(value, (float, np.floating)) and math.isnan(value):  # np.float32('nan') too
            return None  # TRL takes NaN as it takes None
        raise UserError(f"{path}:{func}: returned {value!r} on {p.where} (want a finite number or None)")

    return func, call


def _load_module(path: str) -> Any:
    """The user's file as a module, executed once per version of the file (a run checks its
    settings, estimates its memory and trains with one load)."""
    key = (os.path.abspath(path), os.stat(path).st_mtime_ns)
    if key in _MODULES:
        return _MODULES[key]
    name = f"mlxtoy_reward_{abs(hash(key))}"
    try:
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        with contextlib.redirect_stdout(sys.stderr):  # what it prints is not the product either
            module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # a user's file: any error in it (or exit) is bad input
        raise UserError(f"{path}: loading it failed ({type(e).__name__}: {_one_line(e)})") from None
    _MODULES[key] = module
    return module


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or "(no message)"


def split_specs(text: str) -> list[str]:
    """'exact,regex:a,b,length:9' -> ['exact', 'regex:a,b', 'length:9']: a piece that is not
    a reward of its own continues the regex before it (patterns may hold commas)."""
    out: list[str] = []
    for piece in text.split(","):
        starts = piece.strip() in ("exact", "contains", "numeric", "think-format") or piece.strip().startswith(
            ("regex:", "length:", "overlong:")) or ".py:" in piece
        if out and out[-1].startswith("regex:") and not starts:
            out[-1] += "," + piece
        elif out and out[-1].startswith("overlong:") and "," not in out[-1] and piece.strip().isdigit():
            out[-1] += "," + piece.strip()  # overlong:MAX,CACHE
        elif piece.strip():
            out.append(piece.strip())
    return out


@dataclass
class RewardSet:
    """The run's reward functions, their names (for `rewards/<name>/mean`) and weights."""

    names: list[str]
    fns: list[RewardFn]
    weights: np.ndarray

    @classmethod
    def parse(cls, text: str, weights: Sequence[float] | None = None,
              timeout: float | None = None) -> "RewardSet":
        """`--reward` text -> the rewards; `timeout`: seconds a call of a user's function may take."""
        specs = split_specs(text or "")
        if not specs:
            raise UserError(f"--objective grpo needs --reward NAME[,NAME...] (built-ins: {', '.join(BUILTINS)}; "
                            f"or FILE.py:FUNCTION)")
        names, fns = [], []
        for spec in specs:
            kind, _, arg = spec.partition(":")
            if spec in ("exact", "contains", "numeric", "think-format"):
                name, fn = spec, {"exact": _exact, "contains": _contains, "numeric": _numeric,
                                  "think-format": _think_format}[spec]
            elif kind == "regex" and arg:
                name, fn = "regex", _regex(arg)
            elif kind == "length":
                name, fn = f"length_{arg}", _length(arg)
            elif kind == "overlong":
                name, fn = OVERLONG_NAME, _overlong(arg)
            elif ".py:" in spec:
                name, fn = _load_user(spec, timeout)
            else:
                raise UserError(f"--reward {spec}: unknown reward (built-ins: {', '.join(BUILTINS)}; "
                                f"or FILE.py:FUNCTION)")
            while name in names:  # two regexes, or two functions of one name
                name += "_"
            names.append(name)
            fns.append(fn)
        w = np.ones(len(fns)) if not weights else np.asarray(weights, dtype=np.float64)
        if len(w) != len(fns):
            raise UserError(f"--reward-weights has {len(w)} weights for {len(fns)} rewards ({', '.join(names)})")
        if not np.isfinite(w).all():
            raise UserError("--reward-weights must be finite numbers")
        return cls(names, fns, w)

    def score(self, prompts: Sequence[Any], completions: Sequence[str], lengths: Sequence[int]) -> np.ndarray:
        """(N, rewards): each function on each completion; NaN where it said None."""
        out = np.full((len(completions), len(self.fns)), np.nan)
        for i, (p, text, n) in enumerate(zip(prompts, completions, lengths)):
            for j, fn in enumerate(self.fns):
                v = fn(p, text, int(n))
                if v is not None:
                    out[i, j] = v
        return out

    def combine(self, per_reward: np.ndarray) -> np.ndarray:
        """(N,) the weighted sum, a None (NaN) counting 0; NaN where every reward said None (the
        completion is unscorable: TRL >= 1.6 leaves it out of its group's baseline and gives it
        advantage 0)."""
        if not per_reward.size:
            return np.zeros(len(per_reward))
        total = np.nansum(per_reward * self.weights[None, :], axis=1)
        return np.where(np.isnan(per_reward).all(axis=1), np.nan, total)
