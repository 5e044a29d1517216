"""Which route runs each product and attention on this machine (mlxtoy.routes): chosen by
measuring, tested here with timings injected so that no test depends on this machine's speed.

- the table takes the faster route, and the reference route unless another beats it by MARGIN;
- it measures again when the kept choices are corrupt or were made on another CPU / MLX;
- a route whose values disagree with the reference's is never taken, however fast;
- each route of the attention and of a product gives numpy float64's values, forward and
  gradients; MLXTOY_GEMM / MLXTOY_BLOCK_ATTENTION override the measurement.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import time

import numpy as np
import pytest

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn

from mlxtoy import backend, cpublas, loading, routes
from mlxtoy.models import attention, calibrate, fastmath, fused_weights, quant
from mlxtoy.train.logprobs import calibrate_loss, token_losses

pytestmark = pytest.mark.core

FINGERPRINT = {"cpu": "a test CPU", "mlx": "0.0"}


def fake_timer(seconds: dict[str, float], calls: list[str] | None = None):
    def time_route(name: str, run, first: float, best: float) -> float:
        if calls is not None:
            calls.append(name)
        return seconds[name]
    return time_route


def constant(value: float, shape=(3, 4)):
    """A candidate returning this value (evaluated), and counting its runs."""
    def run():
        run.runs += 1
        return [mx.full(shape, value)]
    run.runs = 0
    return run


def table(tmp_path, seconds: dict[str, float], lines: list[str] | None = None, fingerprint=FINGERPRINT) -> routes.RouteTable:
    t = routes.RouteTable(str(tmp_path / "routes.json"), dict(fingerprint), fake_timer(seconds),
                          log=(lines.append if lines is not None else lambda line: None))
    t.load()
    return t


def test_a_short_route_is_timed_until_a_slow_run_cannot_decide_it(monkeypatch):
    """routes.second_look: a run of a fraction of a millisecond is timed again until the runs
    have taken LOOK_SECONDS, so one slow run (the BLAS's threads waking, another process) is not
    its measure; a long run is timed once more only. The runs' times are injected (`routes.timed`):
    slept for real, a 0.2 ms sleep timed at 5 ms on a machine busy with other tests."""
    def run_taking(durations: list[float]):
        def run():
            run.last = durations[min(run.runs, len(durations) - 1)]
            run.runs += 1
            return []
        run.runs = 0
        return run

    monkeypatch.setattr(routes, "timed", lambda run: (run(), run.last))
    short = run_taking([0.004, 0.0002])  # a slow timed run, then its own time
    seconds = routes.second_look("blas", short, first=0.02, best=float("inf"))
    assert seconds == 0.0002 and 2 <= short.runs <= routes.LOOKS
    long = run_taking([0.03])
    assert routes.second_look("blas", long, first=0.05, best=float("inf")) == 0.03 and long.runs == 1
    control = run_taking([0.004, 0.0002])  # positive control: the old single second look kept 4 ms
    assert min(0.02, routes.timed(control)[1]) >= 0.004


def test_the_faster_route_is_taken_and_kept(tmp_path):
    lines: list[str] = []
    t = table(tmp_path, {"blas": 2.0, "kernels": 1.0}, lines)
    cands = {"blas": constant(1.0), "kernels": constant(1.0)}
    assert t.choose("gemm", ("nt", 256, 64, 64), cands, 1e9, "a product") == "kernels"
    assert t.chosen("gemm", ("nt", 256, 64, 64)).gflops == {"blas": 0.5, "kernels": 1.0}
    assert len(lines) == 1 and "kernels" in lines[0] and "measured in" in lines[0]  # its cost, logged
    # the other way round: the reference route
    t2 = table(tmp_path / "b", {"blas": 1.0, "kernels": 2.0})
    assert t2.choose("gemm", ("nt", 256, 64, 64), {"blas": constant(1.0), "kernels": constant(1.0)}, 1e9, "") == "blas"
    # kept: a new table on the same file does not measure again
    runs = {"blas": constant(1.0), "kernels": constant(1.0)}
    t3 = table(tmp_path, {"blas": 0.1, "kernels": 9.0})
    assert t3.choose("gemm", ("nt", 256, 64, 64), runs, 1e9, "") == "kernels"
    assert runs["blas"].runs == runs["kernels"].runs == 0


def test_routes_are_timed_in_rounds_in_turn_so_a_burst_on_one_round_does_not_decide(tmp_path, monkeypatch):
    """A burst of other work (a BLAS starting its threads, a core waking) that falls on one
    route's first round: the routes' rounds alternate, and each keeps its fastest."""
    def timer(times: dict[str, list[float]], calls: list[str]):
        def time_route(name: str, run, first: float, best: float) -> float:
            calls.append(name)
            return min(times[name][:sum(c == name for c in calls)])  # its fastest round so far
        return time_route

    def measure(rounds: int) -> tuple[str, list[str]]:
        monkeypatch.setattr(routes, "ROUNDS", rounds)
        calls: list[str] = []
        t = routes.RouteTable(str(tmp_path / f"r{rounds}.json"), dict(FINGERPRINT),
                              timer({"blas": [0.002, 0.002], "kernels": [0.006, 0.001]}, calls), log=lambda line: None)
        return t.choose("gemm", ("nt", 256, 64, 64), {"blas": constant(1.0), "kernels": constant(1.0)}, 1e9, ""), calls

    assert measure(2) == ("kernels", ["blas", "kernels", "blas", "kernels"])
    assert measure(1) == ("blas", ["blas", "kernels"])  # positive control: one round, the burst decides


def test_a_process_warms_the_routes_up_before_its_first_measurement_only(tmp_path):
    seen: list[int] = []
    cands = {"blas": constant(1.0), "kernels": constant(1.0)}

    def time_route(name: str, run, first: float, best: float) -> float:
        seen.append(run.runs)
        return 1.0
    t = routes.RouteTable(str(tmp_path / "routes.json"), dict(FINGERPRINT), time_route, log=lambda line: None)
    start = time.perf_counter()
    t.choose("gemm", ("nt", 256, 64, 64), cands, 1e9, "")
    assert time.perf_counter() - start >= routes.WARM_UP_SECONDS
    assert seen[0] > 2  # ran again and again before it was timed (once: the run that gave its values)
    seen.clear()
    again = {"blas": constant(1.0), "kernels": constant(1.0)}
    t.choose("gemm", ("nt", 256, 128, 64), again, 1e9, "")
    assert seen[0] == 1  # the next measurement of the process: its one first run only


def test_the_reference_keeps_its_place_within_the_margin(tmp_path):
    near = 1.0 / (1 + routes.MARGIN / 2)  # faster, but by less than the margin
    t = table(tmp_path, {"blas": 1.0, "kernels": near})
    assert t.choose("gemm", ("nt", 64, 8, 8), {"blas": constant(1.0), "kernels": constant(1.0)}, 1e9, "") == "blas"
    t = table(tmp_path / "b", {"blas": 1.0, "kernels": 0.5})  # control: well past it
    assert t.choose("gemm", ("nt", 64, 8, 8), {"blas": constant(1.0), "kernels": constant(1.0)}, 1e9, "") == "kernels"


def test_a_route_added_since_is_measured_and_one_switched_off_is_left_out(tmp_path):
    shape = (32, 1536, 576)
    t = table(tmp_path, {"blas": 3.0, "gemv": 2.0, "kernels": 1.0})
    two = {"blas": constant(1.0), "gemv": constant(1.0)}
    assert t.choose("few", shape, two, 1e9, "") == "gemv"
    # a new candidate: the kept choice did not measure it, so every route is measured again
    three = {"blas": constant(1.0), "gemv": constant(1.0), "kernels": constant(1.0)}
    assert t.kept_route("few", shape, list(three)) is None
    assert t.choose("few", shape, three, 1e9, "") == "kernels"
    assert three["kernels"].runs > 0
    # a switch leaves one out (MLXTOY_GEMM=0): the fastest of the others by the kept rates, unmeasured
    again = {"blas": constant(1.0), "gemv": constant(1.0)}
    assert t.kept_route("few", shape, list(again)) == "gemv"
    assert t.choose("few", shape, again, 1e9, "") == "gemv" and again["gemv"].runs == 0
    assert t.kept_route("few", shape, list(three)) == "kernels"  # positive control: all three kept


def test_a_route_with_wrong_values_is_never_taken(tmp_path):
    lines: list[str] = []
    t = table(tmp_path, {"blas": 1.0, "kernels": 0.01}, lines)
    choice = t.choose("gemm", ("nt", 64, 8, 8), {"blas": constant(1.0), "kernels": constant(1.001)}, 1e9, "")
    assert choice == "blas" and t.chosen("gemm", ("nt", 64, 8, 8)).gflops["kernels"] is None
    assert "wrong values" in lines[0]
    # positive control: the same timings with the right values take it
    t = table(tmp_path / "b", {"blas": 1.0, "kernels": 0.01})
    assert t.choose("gemm", ("nt", 64, 8, 8), {"blas": constant(1.0), "kernels": constant(1.0 + 1e-7)}, 1e9, "") == "kernels"
    # NaN where the reference has a number, or another shape, disagree too
    assert not routes.agrees([np.array([1.0, np.nan])], [np.array([1.0, 2.0])])
    assert not routes.agrees([np.ones((2, 3))], [np.ones((3, 2))])


@pytest.mark.parametrize("damage", ["garbage", "another CPU", "another MLX", "a route without a rate"])
def test_corrupt_or_stale_choices_are_measured_again(tmp_path, damage):
    t = table(tmp_path, {"blas": 2.0, "kernels": 1.0})
    t.choose("gemm", ("nt", 64, 8, 8), {"blas": constant(1.0), "kernels": constant(1.0)}, 1e9, "")
    path = tmp_path / "routes.json"
    data = json.loads(path.read_text())
    fingerprint = dict(FINGERPRINT)
    if damage == "garbage":
        path.write_text("{not json")
    elif damage == "another CPU":
        data["fingerprint"]["cpu"] = "another CPU"
        path.write_text(json.dumps(data))
    elif damage == "another MLX":
        fingerprint["mlx"] = "9.9"
    else:
        data["choices"]["gemm:ntx64x8x8"]["gflops"]["kernels"] = None
        path.write_text(json.dumps(data))
    fresh = routes.RouteTable(str(path), fingerprint, fake_timer({"blas": 1.0, "kernels": 2.0}), log=lambda line: None)
    why = fresh.load()
    assert why is not None and fresh.chosen("gemm", ("nt", 64, 8, 8)) is None
    cands = {"blas": constant(1.0), "kernels": constant(1.0)}
    assert fresh.choose("gemm", ("nt", 64, 8, 8), cands, 1e9, "") == "blas"  # measured again
    assert cands["kernels"].runs > 0
    # and the file is whole again, under this fingerprint
    assert json.loads(path.read_text())["fingerprint"] == fingerprint


def test_calibrating_again_takes_a_second_look_at_a_kept_choice_rated_by_each_routes_better_look(tmp_path):
    """A choice made while the machine was busy (the kernels timed slow) is kept by every later
    process, but `doctor --calibrate` (`look_again`) measures it again: each route rated by the
    better of its two looks, since other work only ever slows one. Once a process; a route with
    wrong values in either look is never taken. Control: without look_again nothing is timed."""
    shape = ("nt", 256, 64, 64)
    busy = table(tmp_path, {"blas": 1.0, "kernels": 4.0})
    assert busy.choose("gemm", shape, {"blas": constant(1.0), "kernels": constant(1.0)}, 1e9, "") == "blas"
    control = table(tmp_path, {"blas": 1.0, "kernels": 0.25})
    runs = {"blas": constant(1.0), "kernels": constant(1.0)}
    assert control.choose("gemm", shape, runs, 1e9, "") == "blas" and runs["kernels"].runs == 0
    calls: list[str] = []
    lines: list[str] = []
    idle = routes.RouteTable(str(tmp_path / "routes.json"), dict(FINGERPRINT),
                             fake_timer({"blas": 2.0, "kernels": 0.5}, calls), log=lines.append, look_again=True)
    idle.load()
    assert idle.choose("gemm", shape, {"blas": constant(1.0), "kernels": constant(1.0)}, 1e9, "a product") == "kernels"
    # blas: its first look (1.0 GFLOP/s) was the better one; kernels: its second (2.0)
    assert idle.chosen("gemm", *[shape]).gflops == {"blas": 1.0, "kernels": 2.0}
    assert "better of two looks, was blas" in lines[0]
    timed = len(calls)
    assert idle.choose("gemm", shape, {"blas": constant(1.0), "kernels": constant(1.0)}, 1e9, "") == "kernels"
    assert len(calls) == timed  # once a process
    # kept for the next process, which does not look again
    later = table(tmp_path, {"blas": 0.01, "kernels": 9.0})
    assert later.choose("gemm", shape, {"blas": constant(1.0), "kernels": constant(1.0)}, 1e9, "") == "kernels"
    # wrong values in the second look: set aside, whatever its first look's rate
    wrong = routes.RouteTable(str(tmp_path / "routes.json"), dict(FINGERPRINT),
                              fake_timer({"blas": 1.0, "kernels": 0.1}), log=lambda line: None, look_again=True)
    wrong.load()
    assert wrong.choose("gemm", shape, {"blas": constant(1.0), "kernels": constant(1.5)}, 1e9, "") == "blas"
    assert wrong.chosen("gemm", shape).gflops["kernels"] is None
    # and wrong values kept from the first look stay set aside on a second look with right ones
    again = routes.RouteTable(str(tmp_path / "routes.json"), dict(FINGERPRINT),
                              fake_timer({"blas": 1.0, "kernels": 0.1}), log=lambda line: None, look_again=True)
    again.load()
    assert again.choose("gemm", shape, {"blas": constant(1.0), "kernels": constant(1.0)}, 1e9, "") == "blas"


def test_doctor_calibrate_measures_the_kept_routes_again(routed, monkeypatch, capsys):
    """`mlxtoy doctor --calibrate` on a machine whose kept choice was made busy: the attention
    route of a model's shapes, kept as "fast" because "grouped" was timed slow then, is measured
    again and flips to "grouped", timed at its own rate now ("fast" as before). (The shapes are
    a tiny model's, the BLAS libraries' own timing left out.) Control: calibrating without the
    command's second look keeps the choice."""
    from mlxtoy.commands import doctor

    shapes = calibrate.BlockShapes("tiny", 64, 128, 4, 2, 16, 256)
    monkeypatch.setattr(calibrate, "REFERENCE_SHAPES", (shapes,))
    monkeypatch.setattr(calibrate, "calibrate_blas", lambda: {})
    every = lambda faster: collections.defaultdict(lambda: 1.0, faster)  # noqa: E731 (all doctor meets)
    routed(every({"fast": 0.5}))
    calibrate.calibrate(shapes, batch=4, seq_len=256, training=True)
    key = [row for row in calibrate.measured() if row["work"].startswith("attention:")][0]["work"]
    assert fastmath.route_table().choices[key].route == "fast"
    routed(every({"fast": 0.5, "grouped": 0.1}))
    assert fastmath.route_table().load() is None  # (the next process: the kept choices read)
    calibrate.calibrate(shapes, batch=4, seq_len=256, training=True)  # control: kept
    assert fastmath.route_table().choices[key].route == "fast"
    if not backend.INFO.on_cpu:
        pytest.skip("doctor calibrates on the CPU only")
    doctor.run(argparse.Namespace(calibrate=True, json=True))
    assert fastmath.route_table().choices[key].route == "grouped"
    capsys.readouterr()


def test_an_unwritable_cache_costs_a_measurement_not_the_run(tmp_path):
    lines: list[str] = []
    blocker = tmp_path / "file"
    blocker.write_text("")
    t = routes.RouteTable(str(blocker / "routes.json"), FINGERPRINT, fake_timer({"blas": 1.0}), log=lines.append)
    assert t.load() is not None
    assert t.choose("gemm", ("nt", 64, 8, 8), {"blas": constant(1.0)}, 1e9, "") == "blas"
    assert any("could not keep" in line for line in lines)


@pytest.fixture
def routed(tmp_path, monkeypatch):
    """A fresh route table with the given timings (per route name) for the rest of the test."""
    def use(seconds: dict[str, float], calls: list[str] | None = None) -> routes.RouteTable:
        t = routes.RouteTable(str(tmp_path / "routes.json"), FINGERPRINT, fake_timer(seconds, calls), log=lambda line: None)
        before = fastmath.use_route_table(t)
        monkeypatch.setattr(fastmath, "ROUTED_MACS", 1)  # measure even these small shapes
        monkeypatch.setattr(fastmath, "FEW_ROUTED_MACS", 1)
        monkeypatch.setattr(quant, "PROMPT_ROUTED_MACS", 1)
        monkeypatch.setattr(attention, "ROUTED_WORK", 1)
        return before
    yield use
    fastmath.use_route_table(None)


@pytest.mark.parametrize("faster", ["slabs", "gemv"])
def test_a_prompt_through_a_4_bit_matrix_takes_the_route_measured_faster(routed, faster):
    """A prompt's rows through a 4-bit matrix (groups of 32) take the GEMV's rounded form or the
    exact slabs, whichever measured faster for their rows class (timings injected), once per
    class; decoding's 4 rows are not measured. Positive control: the values show which ran (the
    slabs' exactly, the GEMV's within x's rounding). A form whose values are wrong is never taken:
    weights that are not symmetric, multiplied as if they were, leave the slabs even where the
    GEMV is timed faster."""
    if not fastmath.kernels_on() or fastmath.kernels_module().quant_gemv_max_rows(640, 32, 4) <= 4:
        pytest.skip("no rounded 4-bit GEMV for a prompt on this CPU")
    calls: list[str] = []
    routed({"slabs": 1.0, "gemv": 1.0} | {faster: 0.1}, calls)
    rng = np.random.default_rng(0)
    q, s, b = mx.quantize(mx.array(rng.standard_normal((67, 640)).astype(np.float32)), 32, 4)
    s, b = s.astype(mx.float16), b.astype(mx.float16)
    dense = np.array(mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), 32, 4)).astype(np.float64)
    for rows in (9, 12, 4):  # one class of 16 rows; then decoding's
        x = rng.standard_normal((rows, 640)).astype(np.float32)
        with fastmath.inference():
            y = np.array(quant.quant_linear(mx.array(x), q, s, b, 32, 4))
        want = x.astype(np.float64) @ dense.T
        assert np.abs(y - want).max() <= 1e-3 * np.abs(want).max()
        if rows > 4:
            slabs = np.array(quant.quant_linear(mx.array(x), q, s, b, 32, 4))  # outside inference: the slabs
            assert (not np.array_equal(y, slabs)) if faster == "gemv" else np.array_equal(y, slabs)
    assert [c for c in calls if c in ("slabs", "gemv")] == ["slabs", "gemv"]
    calls.clear()
    with fastmath.inference():  # not symmetric: the GEMV's values are wrong, the slabs' right
        y = np.array(quant.quant_linear(mx.array(x[:1].repeat(9, 0)), q, s, b, 32, 4, symmetric=True))
    assert calls == ["slabs"]  # (the GEMV ran once, disagreed, and was not timed)
    np.testing.assert_allclose(y, np.repeat(x[:1], 9, 0) @ dense.T, rtol=0, atol=1e-3)


def _attention_problem(B=2, H=4, KV=2, T=24, D=16, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal(s) for s in ((B, H, T, D), (B, KV, T, D), (B, KV, T, D), (B, H, T, D)))
    return q, k, v, g


def _attention_reference(q, k, v, g, scale):
    """Causal attention and its gradients in float64 numpy (grouped heads share their KV head)."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = scale * q @ kk.swapaxes(-1, -2)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ vv
    dp = g @ vv.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = scale * ds @ kk
    dk = (scale * ds.swapaxes(-1, -2) @ q).reshape(B, k.shape[1], G, T, D).sum(2)
    dv = (p.swapaxes(-1, -2) @ g).reshape(B, k.shape[1], G, T, D).sum(2)
    return out, dq, dk, dv


@pytest.mark.parametrize("route", ["fast", "grouped", "block"])
def test_every_attention_route_gives_float64_values_and_gradients(routed, route):
    if route == "block" and not attention.block_attention_on():
        pytest.skip("the kernels' block attention does not run here")
    others = {"fast": 1.0, "grouped": 1.0, "block": 1.0}
    routed(others | {route: 0.1})  # this route measures fastest
    q, k, v, g = _attention_problem()
    scale = 0.25
    arrays = [mx.array(a.astype(np.float32)) for a in (q, k, v, g)]
    assert attention.attention_route(2, 4, 2, 24, 24, 16, training=True) == route  # positive control
    out = attention.attention(*arrays[:3], scale, "causal")
    grads = mx.grad(lambda q, k, v: (attention.attention(q, k, v, scale, "causal") * arrays[3]).sum(),
                    argnums=(0, 1, 2))(*arrays[:3])
    want = _attention_reference(q, k, v, g, scale)
    for got, ref in zip([out, *grads], want):
        np.testing.assert_allclose(np.array(got), ref, rtol=0, atol=2e-5)


def test_the_attention_switch_overrides_the_measurement(routed, monkeypatch):
    if not attention.block_attention_on():
        pytest.skip("the kernels' block attention does not run here")
    routed({"fast": 1.0, "grouped": 0.1, "block": 1.0})
    assert attention.attention_route(2, 4, 2, 24, 24, 16, training=True) == "grouped"  # measured
    monkeypatch.setenv("MLXTOY_BLOCK_ATTENTION", "1")
    assert attention.attention_route(2, 4, 2, 24, 24, 16, training=True) == "block"
    monkeypatch.setenv("MLXTOY_BLOCK_ATTENTION", "0")
    assert not attention.block_attention_on()
    assert attention.attention_route(2, 4, 2, 24, 24, 16, training=False) in ("fast", "grouped")


needs_gemm = pytest.mark.skipif(not fastmath.gemm_on(), reason="the kernels' GEMM does not run here")


def _graph(y: mx.array) -> str:
    import io

    buf = io.StringIO()
    mx.export_to_dot(buf, y)
    return buf.getvalue()


@needs_gemm
@pytest.mark.parametrize("faster", ["blas", "kernels"])
def test_every_product_route_gives_float64_values_and_input_gradient(routed, faster):
    routed({"blas": 1.0, "kernels": 1.0} | {faster: 0.1})
    r = np.random.default_rng(5)
    x = r.standard_normal((2, 40, 64))
    w = r.standard_normal((96, 64)) / 8
    g = r.standard_normal((2, 40, 96))
    xa, wa, ga = (mx.array(a.astype(np.float32)) for a in (x, w, g))
    y = fastmath.linear(xa, wa)
    assert ("MlxtoyKernel" in _graph(y)) == (faster == "kernels")  # positive control: the route ran
    np.testing.assert_allclose(np.array(y), x @ w.T, rtol=0, atol=2e-5)
    dx, dw = mx.grad(lambda x, w: (fastmath.linear(x, w) * ga).sum(), argnums=(0, 1))(xa, wa)
    np.testing.assert_allclose(np.array(dx), g @ w, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.array(dw), g.reshape(-1, 96).T @ x.reshape(-1, 64), rtol=0, atol=1e-4)


@needs_gemm
@pytest.mark.parametrize("switch", ["0", "1"])
def test_the_gemm_switch_ignores_the_measurement(routed, monkeypatch, switch):
    calls: list[str] = []
    routed({"blas": 0.1, "kernels": 1.0} if switch == "1" else {"blas": 1.0, "kernels": 0.1}, calls)
    monkeypatch.setenv("MLXTOY_GEMM", switch)
    x = mx.ones((40, 64))
    w = mx.ones((96, 64))
    assert ("MlxtoyKernel" in _graph(fastmath.linear(x, w))) == (switch == "1")
    assert calls == []  # nothing was measured


def test_calibration_measures_a_models_shapes_and_doctor_shows_them(routed, capsys):
    routed({"blas": 1.0, "kernels": 1.0, "fast": 1.0, "grouped": 0.5, "block": 1.0})
    shapes = calibrate.BlockShapes("tiny", 64, 128, 4, 2, 16, 256)
    calibrate.calibrate(shapes, batch=2, seq_len=24, training=True)
    rows = calibrate.measured()
    products = [row for row in rows if row["work"].startswith("gemm:")]
    # five matrices, forward, input and weight gradients, each shape class measured once: q and o
    # are both 64 x 64 here, so 4 forward and 4 input-gradient shapes; the weight gradients' rows
    # classes (q, k/v, o: 64; gate/up: 256; down: 64) leave 3
    assert len(products) == (11 if fastmath.gemm_on() else 0)
    assert {row["work"].split("x", 1)[0] for row in products} == ({"gemm:nt", "gemm:nn", "gemm:tn"} if fastmath.gemm_on() else set())
    att = [row for row in rows if row["work"].startswith("attention:")]
    assert len(att) == 1 and att[0]["route"] == "grouped"
    assert all(row["seconds"] >= 0 for row in rows)


def test_a_device_flip_after_import_reaches_every_module(monkeypatch):
    """--device picks the GPU after import (here a GPU MLX says it has, while MLX computes on
    the CPU), then the CPU again: fastmath, attention, quant and memory follow the one object."""
    from mlxtoy.models.quant import QuantPlan, quantize_dense, quantized_module
    from mlxtoy.train import memory

    monkeypatch.setattr(backend, "gpu_name", lambda: "cuda")
    monkeypatch.setattr(mx, "set_default_device", lambda device: None)
    monkeypatch.setattr(loading, "source_size", lambda model: (1000, True))
    qmm = []
    real_qmm = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **kw: qmm.append(1) or real_qmm(*a, **kw))
    packed, _ = quantize_dense(mx.array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)), QuantPlan())
    layer = quantized_module(fastmath.Linear(64, 64, bias=False), packed)
    x = mx.ones((1, 8, 64))
    kernels_before = fastmath.kernels_on()
    try:
        backend.use_device("gpu")
        assert backend.INFO.device == "cuda" and not fastmath.kernels_on()
        assert attention.attention_route(1, 4, 2, 64, 64, 16, training=True) == "fast"
        assert loading.quant_plan("x.gguf", "auto") is not None  # a quantized file stays quantized on a GPU
        assert not backend.INFO.compiled_decode
        mx.eval(layer(x))
        assert qmm, "on the GPU a quantized base multiplies through mx.quantized_matmul"
        backend.use_device("cpu")
        qmm.clear()
        assert backend.INFO.device == "cpu" and fastmath.kernels_on() == kernels_before
        assert backend.INFO.compiled_decode and backend.INFO.compute_dtype == mx.float32
        mx.eval(layer(x))
        assert not qmm  # control: the CPU dequantizes slabs into the float32 GEMM
    finally:
        backend.use_device("cpu")


def test_the_blas_measured_fastest_loads_first_and_a_stale_or_broken_measurement_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXTOY_CACHE", str(tmp_path))
    monkeypatch.delenv("MLXTOY_BLAS", raising=False)
    libraries = {"mkl": "/lib/libmkl_rt.so.2", "openblas": "/lib/libopenblas.so.0"}
    monkeypatch.setattr(cpublas, "blas_libraries", lambda: {"mkl": [("mkl", libraries["mkl"])],
                                                            "openblas": [("openblas", libraries["openblas"])], "blis": []})
    intel, zen5 = ("GenuineIntel", {"avx512f"}), ("AuthenticAMD", {"avx512f"})
    first = lambda cpu: cpublas.blas_candidates(*cpu)[0][0]
    assert (first(intel), first(zen5)) == ("mkl", "openblas")  # unmeasured: the guess (the control)
    path = tmp_path / cpublas.BLAS_FILE
    for fastest in ("openblas", "mkl"):
        path.write_text(json.dumps({"fingerprint": cpublas.blas_fingerprint(libraries), "fastest": fastest}))
        assert first(intel) == first(zen5) == fastest
    stale = dict(cpublas.blas_fingerprint(libraries), cpu="another CPU")
    for text in ("{broken", json.dumps({"fingerprint": stale, "fastest": "openblas"}),
                 json.dumps({"fingerprint": cpublas.blas_fingerprint(libraries), "fastest": "blis"})):
        path.write_text(text)
        assert cpublas.measured_blas(libraries) is None and first(intel) == "mkl"
    monkeypatch.setenv("MLXTOY_BLAS", "mkl")  # the switch wins over the measurement
    path.write_text(json.dumps({"fingerprint": cpublas.blas_fingerprint(libraries), "fastest": "openblas"}))
    assert first(zen5) == "mkl"


def test_calibrating_the_blas_times_each_library_in_its_own_process(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXTOY_CACHE", str(tmp_path))
    work = {"small": [("nt", 64, 48, 32), ("nn", 64, 32, 48), ("tn", 48, 32, 64)], "square": [("nt", 96, 96, 96)]}
    monkeypatch.setattr(calibrate, "blas_workload", lambda: work)
    found = cpublas.blas_paths()
    rates = calibrate.calibrate_blas()
    assert set(rates) == set(found) and all(rate and rate > 0 for rate in rates.values())
    if len(found) > 1:
        kept = json.loads((tmp_path / cpublas.BLAS_FILE).read_text())
        assert kept["fastest"] == max(rates, key=rates.get)
        assert cpublas.measured_blas(found) == kept["fastest"]


def test_calibrating_the_blas_again_rates_each_library_by_its_better_calibration(tmp_path, monkeypatch):
    """A slow phase of the machine only ever slows a look: a library's rate is the better of this
    calibration's and the one kept from before on this machine (positive control: with nothing
    kept, this calibration's own rates), so one slow run cannot turn the choice around."""
    monkeypatch.setenv("MLXTOY_CACHE", str(tmp_path))
    libraries = {"mkl": "/lib/libmkl_rt.so.2", "openblas": "/lib/libopenblas.so.0"}
    monkeypatch.setattr(cpublas, "blas_paths", lambda: libraries)
    work = {"one": [("nt", 1000, 1000, 1000)]}  # 2 GFLOP: its rate is 2 / seconds
    monkeypatch.setattr(calibrate, "blas_workload", lambda: work)
    now = {"mkl": 0.01, "openblas": 0.008}  # this run: a slow phase for MKL (200 vs 250)

    def probe(args, env, **kwargs):
        kind = env["MLXTOY_BLAS"]
        return subprocess.CompletedProcess(args, 0, json.dumps({"blas": kind, "seconds": {"one": [now[kind]]}}), "")

    monkeypatch.setattr(calibrate.subprocess, "run", probe)
    assert calibrate.calibrate_blas() == pytest.approx({"mkl": 200.0, "openblas": 250.0})  # nothing kept yet
    assert cpublas.measured_blas(libraries) == "openblas"
    path = tmp_path / cpublas.BLAS_FILE
    kept = json.loads(path.read_text())
    path.write_text(json.dumps(kept | {"fastest": "mkl", "gflops": {"mkl": 300.0, "openblas": 240.0}}))
    assert calibrate.calibrate_blas() == pytest.approx({"mkl": 300.0, "openblas": 250.0})
    assert cpublas.measured_blas(libraries) == "mkl"


def test_a_blas_is_rated_by_each_models_step_and_the_models_count_alike():
    work = {"small": [("nt", 10, 20, 30), ("tn", 30, 20, 10)], "large": [("nn", 100, 200, 300)]}
    seconds = {"small": [1e-6, 3e-6], "large": [4e-4]}
    small, large = 2 * 2 * 6000 / 4e-6 / 1e9, 2 * 6e6 / 4e-4 / 1e9  # 6 and 30 GFLOP/s
    assert calibrate.blas_rate(work, seconds) == pytest.approx((small * large) ** 0.5)
    # the step of each reference model: a forward, an input and a weight gradient of q, gate/up and down
    products = calibrate.blas_products(calibrate.REFERENCE_SHAPES[0], 1024)
    assert ("nt", 1024, 1536, 576) in products and ("nn", 1024, 576, 1536) in products
    assert ("tn", 576, 1536, 1024) in products and len(products) == 9


@pytest.mark.parametrize("faster", ["blas", "gemv", "kernels"])
def test_a_batch_of_decoded_rows_takes_the_measured_route_with_float64_values(routed, faster):
    if not fastmath.kernels_on():
        pytest.skip("the kernels are off here")
    if faster == "kernels" and not fastmath.gemm_on():
        pytest.skip("the kernels' GEMM does not run here")
    routed({"blas": 1.0, "gemv": 1.0, "kernels": 1.0} | {faster: 0.1})
    r = np.random.default_rng(7)
    x = r.standard_normal((3, 4, 64))  # 12 rows
    w = r.standard_normal((40, 64)) / 8
    heads = r.standard_normal((3, 16, 64)) / 8  # a per-head projection
    xa, wa, ha = (mx.array(a.astype(np.float32)) for a in (x, w, heads))
    with fastmath.inference():
        y, yh = fastmath.linear_many(xa, [wa, ha])
        one = fastmath.linear(xa, wa)
    # positive control: the route ran, bit for bit
    assert ("MlxtoyKernel" in _graph(one)) == (faster != "blas")
    flat = xa.reshape(-1, 64)
    K = fastmath.kernels_module()
    ran = {"blas": lambda: flat @ wa.T, "gemv": lambda: K.gemv_many(flat, [wa])[0],
           "kernels": lambda: K.gemm_many(flat, [wa])[0]}[faster]()
    np.testing.assert_array_equal(np.array(one).reshape(-1, 40), np.array(ran))
    np.testing.assert_allclose(np.array(y), x @ w.T, rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.array(one), x @ w.T, rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.array(yh), np.einsum("abk,hdk->abhd", x, heads), rtol=0, atol=2e-5)


@pytest.mark.parametrize("faster", ["ops", "fused"])
def test_a_short_prompt_takes_the_prefill_route_measured_faster(routed, faster):
    """A prompt of a few tokens goes through each block as the fused kernel's one call or op by
    op, whichever measured faster for its rows class (timings injected); either gives the
    uncached forward's hidden states. Positive control: the graph shows which ran. The class is
    measured once for every block of one shape, and a prompt of 4 tokens or fewer is not measured."""
    if not fastmath.kernels_on():
        pytest.skip("the kernels are off here")
    from test_decode_block import PROMPT, VARIANTS, prefill, tiny

    calls: list[str] = []
    others = dict.fromkeys(["blas", "gemv", "kernels", "fast", "grouped", "block"], 1.0)  # the ops' own routes
    routed(others | {"ops": 1.0, "fused": 1.0} | {faster: 0.1}, calls)
    model = tiny(VARIANTS["gqa"])
    for tokens in (PROMPT[:10], PROMPT[:12]):  # both of the class of 16 new tokens
        got, _, graph = prefill(model, [tokens])
        assert graph.count("MlxtoyDecodeBlock") == (len(model.layers) if faster == "fused" else 0)
        want = np.array(model.hidden(mx.array([tokens])))[0]
        np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
    measured = lambda: [c for c in calls if c in ("ops", "fused")]  # noqa: E731
    assert measured() == ["ops", "fused"]
    _, _, graph = prefill(model, [PROMPT[:4]])
    assert graph.count("MlxtoyDecodeBlock") == len(model.layers) and measured() == ["ops", "fused"]


@pytest.mark.parametrize("faster", [1, 8])
def test_one_row_against_packs_takes_the_rows_a_pass_measured_faster(routed, faster):
    """Decoding one row against a model's 8-bit packs reads them at the rows a pass measured
    faster (timings injected; the kernels then report that setting), measured once for the form
    and size class: a second decoder takes the kept choice. Positive control: the other timing
    sets the other pass. Its values are tested at every setting in test_decode_block."""
    K = fastmath.kernels_module()
    if not fastmath.kernels_on() or not K.packed_row_pass("q8_0"):
        pytest.skip("the packed GEMV's passes do not run here")
    from test_decode_block import Q8_0, VARIANTS, decode_steps, q4_model

    calls: list[str] = []
    others = dict.fromkeys(["blas", "gemv", "kernels", "fast", "grouped", "block", "ops", "fused"], 1.0)
    routed(others | {str(n): 1.0 for n in fused_weights.ROW_PASSES} | {str(faster): 0.1}, calls)
    model = q4_model(VARIANTS["gqa"], qtype=Q8_0)
    measured = lambda: sorted(int(c) for c in calls if c.isdigit())  # noqa: E731
    try:
        decode_steps(model, 2, fused=True)
        assert K.packed_row_pass("q8_0") == faster and measured() == list(fused_weights.ROW_PASSES)
        K.set_packed_row_pass("q8_0", 0)
        decode_steps(model, 2, fused=True)  # a new decoder: the kept choice, not measured again
        assert K.packed_row_pass("q8_0") == faster and measured() == list(fused_weights.ROW_PASSES)
    finally:
        K.set_packed_row_pass("q8_0", 0)


@pytest.mark.parametrize("faster", ["blas", "kernels"])
def test_after_calibration_a_training_step_measures_nothing(routed, faster):
    """`doctor --calibrate`'s measurements for a model's shapes (`calibrate.calibrate` and
    `logprobs.calibrate_loss`) cover every route a training step of that model then meets: its
    blocks' products, their gradients, the attention and the loss through the vocabulary, with
    the output layer trained (full fine-tuning) and frozen. Positive control: the same steps on a
    fresh table measure."""
    from test_decode_block import VARIANTS, tiny

    calls: list[str] = []
    timings = {"blas": 1.0, "kernels": 1.0, "fast": 1.0, "grouped": 0.5, "block": 1.0} | {faster: 0.1}
    batch, seq_len = 2, 24
    model = tiny(VARIANTS["gqa"])
    inputs = mx.array(np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, seq_len + 1)))

    def steps():
        for frozen_output in (False, True):
            model.unfreeze()
            if frozen_output:
                model.tok_embeddings.freeze()
            loss = lambda m: token_losses(m, inputs[:, :-1], inputs[:, 1:]).mean()  # noqa: E731
            mx.eval(nn.value_and_grad(model, loss)(model))

    routed(timings, calls)
    steps()
    assert calls  # positive control: a step on a fresh table measures
    routed(timings, calls)
    shapes = calibrate.BlockShapes.of(model.config)
    calibrate.calibrate(shapes, batch, seq_len, training=True)
    calibrate_loss(batch * seq_len, shapes.vocab, shapes.d_model)
    measured = len(calls)
    steps()
    assert len(calls) == measured, [row["work"] for row in calibrate.measured()]


def test_calibration_measures_the_prefill_routes_that_a_model_of_those_shapes_then_takes(routed):
    """`calibrate_prefill` (`doctor --calibrate`) measures each rows class of a short prompt for
    float32 and 4-bit blocks of a shape up front (timings injected: the fused call faster), and
    blocks kept 4-bit where the fused call reads them (their products' prompt routes measured on
    the way); a model of that shape, float32, on a Q4_1 grid or kept 4-bit, then prefills through
    the fused blocks with nothing measured. Positive control: a model of another shape is
    measured when it first meets a prompt."""
    if not fastmath.kernels_on():
        pytest.skip("the kernels are off here")
    from test_decode_block import PROMPT, VARIANTS, prefill, q4_model, quantized_base, tiny

    calls: list[str] = []
    others = dict.fromkeys(["blas", "gemv", "kernels", "fast", "grouped", "block", "slabs"], 1.0)
    routed(others | {"ops": 1.0, "fused": 0.1}, calls)
    model = tiny(VARIANTS["gqa"])
    a4 = fastmath.affine_decode_ok(model.config.d_model) and fastmath.affine_decode_ok(model.config.d_ff)
    forms = ["f32", "q4"] + (["a4"] if a4 else [])
    calibrate.calibrate_prefill(calibrate.BlockShapes.of(model.config))
    rows = [row for row in calibrate.measured() if row["work"].startswith("prefill:")]
    assert sorted(int(row["work"].split(":")[1].split("x")[0]) for row in rows) == sorted([8, 16, 32, 64, 128] * len(forms))
    assert sorted({row["work"].rsplit("x", 1)[1] for row in rows}) == ["/".join([f] * 7) for f in sorted(forms)]
    assert {row["route"] for row in rows} == {"fused"}
    if a4:  # the 4-bit products' prompt routes, measured by the op-by-op runs (a Q4_0 block's: symmetric)
        quant_rows = [row["work"] for row in calibrate.measured() if row["work"].startswith("quant-prompt:")]
        assert quant_rows and all(work.endswith("xsym") for work in quant_rows)
    prefills = lambda: [c for c in calls if c in ("ops", "fused")]  # noqa: E731
    assert prefills() == ["ops", "fused"] * 5 * len(forms)
    models = [model, q4_model(VARIANTS["gqa"])] + ([quantized_base(tiny(VARIANTS["gqa"]))] if a4 else [])
    for i, m in enumerate(models):
        tol = 2e-3 if i == 2 else 1e-4  # kept 4-bit: x rounded to 16 bits a group, against the slabs
        for tokens in (PROMPT[:6], PROMPT[:13]):  # the classes of 8 and 16 new tokens
            got, _, graph = prefill(m, [tokens])
            assert graph.count("MlxtoyDecodeBlock") == len(m.layers)
            np.testing.assert_allclose(got[0], np.array(m.hidden(mx.array([tokens])))[0], rtol=tol, atol=tol)
    assert len(prefills()) == 10 * len(forms)  # nothing measured since
    other = tiny(VARIANTS["gqa"] | {"d_ff": 128})
    prefill(other, [PROMPT[:6]])
    assert len(prefills()) == 10 * len(forms) + 2
