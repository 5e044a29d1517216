"""The code paths a Mac's GPU (Metal) and an NVIDIA GPU (CUDA) take, run on this CPU with the
branch forced, as tests/test_portable_ops.py's `gpu_dispatch` does: `backend.INFO.device` set to
"metal" / "cuda", the CPU kernels off, and the MLX calls that need the real device (the wired
limit, the device's facts, a GPU stream) replaced by recorders.

- wired memory (mlx-lm's `wired_limit`) around every use of a model: generate, chat, export, the
  TUI's chat and export, training; the warning above 0.9 of the working set; the old limit back;
- each thread that runs MLX work on its own thread-local stream;
- float16 where the Apple GPU emulates bfloat16 (M1 / M2), shown by doctor;
- an out-of-memory error during training or generation as one `error:` line;
- one quantization policy, asked by train, generate, chat and the TUI.
"""

from __future__ import annotations

import asyncio
import io
import threading
from contextlib import redirect_stderr, redirect_stdout

import mlx.core as mx
import numpy as np
import pytest

from helpers_train import qa_rows, write_jsonl, write_tiny_model_folder
from mlxtoy import backend, inference, loading
from mlxtoy.cli import main
from mlxtoy.commands import doctor
from mlxtoy.commands import export as export_command
from mlxtoy.commands import generate as generate_command
from mlxtoy.engine import Request
from mlxtoy.generate import generate_tokens
from mlxtoy.models.quant import QUANTIZED_TYPES, QuantPlan
from mlxtoy.serve import EngineThread, Job
from mlxtoy.train import job
from mlxtoy.train.step import Stepper
from tui.generation import Generator, MLXThread, Source

GB = 10**9
# what MLX's Metal backend raises when a command buffer runs out of memory (ml-explore/mlx#479)
METAL_OOM = ("[METAL] Command buffer execution failed: Insufficient Memory "
             "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    model = write_tiny_model_folder(str(root / "model"))
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(24, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(4, seed=2))
    return {"root": root, "model": model, "data": str(data)}


class Metal:
    """The Metal branch on this CPU: what MLX's Metal calls were asked, in order (`events`),
    with the wired limit as Metal keeps it (`set_wired_limit` returns the one it replaces)."""

    def __init__(self, monkeypatch, recommended: int = 16 * GB, arch: str = "applegpu_g15s"):
        self.events: list[tuple] = []
        self.wired = 0
        self.info = {"architecture": arch, "max_recommended_working_set_size": recommended,
                     "memory_size": 2 * recommended}
        monkeypatch.setattr(backend.INFO, "device", "metal")  # every module asks this one object
        monkeypatch.setattr(backend.INFO, "kernels", None)
        monkeypatch.setattr(mx, "device_info", lambda *a, **kw: dict(self.info))
        monkeypatch.setattr(mx, "set_wired_limit", self.set_wired_limit)
        monkeypatch.setattr(mx, "set_cache_limit", lambda limit: self.events.append(("cache", limit)) or 0)
        # the GPU's thread-local stream, made on the CPU here (this MLX has no GPU stream)
        self.streams_asked: list = []
        real_new = mx.new_thread_local_stream
        monkeypatch.setattr(mx, "new_thread_local_stream",
                            lambda device: self.streams_asked.append(device) or real_new(mx.cpu))
        monkeypatch.setattr(backend, "THREAD_STREAMS", {})

    def set_wired_limit(self, limit: int) -> int:
        self.events.append(("wired", limit))
        old, self.wired = self.wired, limit
        return old

    def mark(self, what: str):
        """A wrapper that records `what` each time the wrapped function's work runs."""
        def wrap(fn):
            def run(*args, **kw):
                self.events.append((what,))
                return fn(*args, **kw)
            return run
        return wrap

    def wired_spans(self) -> list[list[str]]:
        """The events between each raising of the wired limit and its restoring."""
        spans, inside = [], None
        for event in self.events:
            if event[0] == "wired":
                if event[1]:
                    inside = []
                else:
                    spans.append(inside)
                    inside = None
            elif inside is not None:
                inside.append(event[0])
        return spans


def _cli(*argv: str, stdin: str = "") -> tuple[int, str, str]:
    err, out = io.StringIO(), io.StringIO()
    import sys

    real_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with redirect_stderr(err), redirect_stdout(out):
            code = main(list(argv))
    finally:
        sys.stdin = real_stdin
    return code, out.getvalue(), err.getvalue()


def _stream_marked(metal: Metal, module, name: str, what: str, monkeypatch) -> None:
    """Each chunk that `module.name` (a generator function) yields is recorded as `what`."""
    real = getattr(module, name)

    def marked(*args, **kw):
        for chunk in real(*args, **kw):
            metal.events.append((what,))
            yield chunk

    monkeypatch.setattr(module, name, marked)


# ---------------------------------------------------------------- wired memory


def test_generate_wires_the_model_while_it_generates_and_restores_the_limit(work, monkeypatch):
    metal = Metal(monkeypatch)
    _stream_marked(metal, generate_command, "stream_generate", "token", monkeypatch)
    code, out, err = _cli("generate", "--model", work["model"], "--prompt", "12+1", "--max-tokens", "3")
    assert code == 0, err
    assert metal.events[0] == ("wired", 16 * GB) and metal.events[-1] == ("wired", 0)
    assert metal.wired_spans() == [["token"] * 3]  # every token inside the wired span
    assert "warning" not in err


def test_a_model_near_the_working_set_is_warned_about_once(work, monkeypatch):
    """mlx-lm's rule: above 0.9 of the recommended working set, one warning line (the memory
    budget, MLXTOY_MEMORY_GB here, leaves the dense model room, as a Mac's would)."""
    model, _ = loading.load(work["model"])
    size = backend.tree_bytes(model)
    monkeypatch.setenv("MLXTOY_MEMORY_GB", "64")
    metal = Metal(monkeypatch, recommended=int(size / 0.95))
    code, _, err = _cli("generate", "--model", work["model"], "--prompt", "12+1", "--max-tokens", "2")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "recommended working set" in warnings[0], err
    assert ("wired", int(size / 0.95)) in metal.events
    metal.info["max_recommended_working_set_size"] = int(size / 0.85)  # control: below 0.9, quiet
    code, _, err = _cli("generate", "--model", work["model"], "--prompt", "12+1", "--max-tokens", "2")
    assert code == 0 and "warning" not in err, err


def test_chat_wires_the_model_for_each_turn(work, monkeypatch):
    metal = Metal(monkeypatch)
    code, out, err = _cli("chat", "--model", work["model"], "--max-tokens", "2", "--quiet",
                          stdin="12+1\n40+1\n")
    assert code == 0, err
    assert [e for e in metal.events if e[0] == "wired"] == [("wired", 16 * GB), ("wired", 0)] * 2
    assert out.count("\n") == 2  # two replies


def test_export_wires_the_weights_while_it_writes(work, monkeypatch, tmp_path):
    metal = Metal(monkeypatch)
    monkeypatch.setattr(export_command, "export_source", metal.mark("write")(export_command.export_source))
    code, out, err = _cli("export", work["model"], "--out", str(tmp_path / "m.gguf"))
    assert code == 0, err
    assert metal.wired_spans() == [["write"]] and metal.wired == 0


def test_the_tui_chat_wires_the_model_on_its_thread(work, monkeypatch):
    metal = Metal(monkeypatch)
    thread = MLXThread()
    generator = Generator()
    try:
        thread.submit(generator.load, Source("tiny", work["model"])).result()
        texts: list[str] = []
        stats = thread.submit(generator.generate, "12+1", False, {"temp": 0.0, "top_p": 1.0, "max_tokens": 3},
                              lambda t: texts.append(t) or metal.events.append(("token",)),
                              threading.Event()).result()
    finally:
        thread.shutdown()
    assert stats and texts
    spans = metal.wired_spans()
    assert len(spans) == 1 and spans[0] and set(spans[0]) == {"token"} and metal.wired == 0


def test_training_wires_the_model_for_the_whole_run_and_logs_it(work, monkeypatch, tmp_path):
    metal = Metal(monkeypatch)
    monkeypatch.setattr(Stepper, "__call__", metal.mark("step")(Stepper.__call__))
    code, out, err = _cli("train", "--model", work["model"], "--data", work["data"], "--out",
                          str(tmp_path / "run"), "--steps", "3", "--batch-size", "2", "--seq-len", "32",
                          "--eval-every", "0")
    assert code == 0, err
    assert metal.wired_spans() == [["cache", "step", "step", "step"]]  # the cache limit, then the steps
    assert "Metal wired limit 16.0 GB" in " ".join(err.split())


def test_on_the_cpu_nothing_is_wired(work, monkeypatch):
    """Control: the same commands on the CPU's branch leave the wired limit alone."""
    calls = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(limit) or 0)
    assert backend.INFO.device == "cpu"
    code, _, err = _cli("generate", "--model", work["model"], "--prompt", "12+1", "--max-tokens", "2")
    assert code == 0, err
    assert calls == []


# ---------------------------------------------------------------- thread-local streams


def test_a_stream_belongs_to_the_thread_that_made_it():
    """Why threads need their own stream (positive control for the next test): since MLX 0.31.2
    a stream made on one thread cannot run work from another, on the CPU as on a GPU."""
    made_here = mx.new_stream(mx.cpu)
    failure = []

    def use() -> None:
        try:
            with mx.stream(made_here):
                mx.eval(mx.ones((4,)) * 2)
        except RuntimeError as e:
            failure.append(str(e))

    worker = threading.Thread(target=use)
    worker.start()
    worker.join()
    assert failure and "Stream" in failure[0]


def test_every_thread_that_runs_mlx_work_takes_the_device_s_thread_local_stream(work, monkeypatch):
    """On Metal, the TUI's MLX thread (loading, generating, exporting) and any thread started
    through `backend.with_thread_stream` run on one mx.new_thread_local_stream of the GPU (made
    here on the CPU, where the GPU's does not exist), and compute what the main thread does."""
    metal = Metal(monkeypatch)
    model, _ = loading.load(work["model"])
    tokens = mx.array([[5, 6, 7, 8]])
    expected = np.array(model(tokens))
    main_stream = mx.default_stream(mx.default_device())

    def forward():
        return np.array(model(tokens)), mx.default_stream(mx.default_device())

    thread = MLXThread()
    try:
        on_tui_thread, tui_stream = thread.submit(forward).result()
    finally:
        thread.shutdown()
    box = {}
    worker = threading.Thread(target=backend.with_thread_stream(lambda: box.update(out=forward())))
    worker.start()
    worker.join()
    assert metal.streams_asked == [mx.gpu]  # one thread-local stream, of the GPU, for both threads
    np.testing.assert_array_equal(on_tui_thread, expected)
    np.testing.assert_array_equal(box["out"][0], expected)
    assert tui_stream != main_stream and box["out"][1] != main_stream


def test_the_server_s_engine_thread_takes_the_thread_local_stream(work, monkeypatch):
    """`mlxtoy serve`'s engine thread decodes on the GPU's thread-local stream, and answers
    what the main thread's decoding answers."""
    metal = Metal(monkeypatch)
    model, _ = loading.load(work["model"])
    prompt = [5, 6, 7, 8, 9]
    expected = [t for t, _ in generate_tokens(model, prompt, max_tokens=4)]

    async def serve_one() -> list[int]:
        queue: asyncio.Queue = asyncio.Queue()
        engine = EngineThread(model)
        try:
            engine.submit(Job([Request(prompt, max_tokens=4)], 1, asyncio.get_running_loop(), queue))
            tokens = []
            while True:
                index, item = await asyncio.wait_for(queue.get(), 60)
                assert index is not None, item  # (None, message): the engine failed
                tokens.append(item.token)
                if item.finish:
                    return tokens
        finally:
            engine.close(10)

    assert asyncio.run(serve_one()) == expected
    assert metal.streams_asked == [mx.gpu]


# ---------------------------------------------------------------- the compute dtype


@pytest.mark.parametrize("arch,dtype", [("applegpu_g13s", "float16"), ("applegpu_g14g", "float16"),
                                        ("applegpu_g15s", "bfloat16"), ("applegpu_g16s", "bfloat16")])
def test_metal_computes_in_float16_where_the_chip_emulates_bfloat16(arch, dtype, monkeypatch):
    """M1 (g13) and M2 (g14) emulate bfloat16: `--device gpu` there computes in float16, M3+ in
    bfloat16; doctor says which and why; MLXTOY_DTYPE still decides over it."""
    monkeypatch.setattr(backend, "gpu_name", lambda: "metal")
    monkeypatch.setattr(mx, "set_default_device", lambda device: None)
    monkeypatch.setattr(mx, "device_info", lambda *a, **kw: {"architecture": arch})
    try:
        backend.use_device("gpu")
        assert backend.INFO.device == "metal" and backend.INFO.compute_dtype == getattr(mx, dtype)
        facts = doctor.report()
        assert facts["compute dtype"] == dtype and (arch in facts["compute dtype why"])
        assert ("emulates" in facts["compute dtype why"]) == (dtype == "float16")
        monkeypatch.setenv("MLXTOY_DTYPE", "bfloat16")
        backend.use_device("gpu")
        assert backend.INFO.compute_dtype == mx.bfloat16 and "MLXTOY_DTYPE" in backend.INFO.dtype_why
    finally:
        monkeypatch.delenv("MLXTOY_DTYPE", raising=False)
        backend.use_device("cpu")
    assert backend.INFO.compute_dtype == mx.float32  # control: the CPU's


def test_cuda_keeps_bfloat16(monkeypatch):
    monkeypatch.setattr(backend, "gpu_name", lambda: "cuda")
    monkeypatch.setattr(mx, "set_default_device", lambda device: None)
    try:
        assert backend.use_device("gpu").compute_dtype == mx.bfloat16
    finally:
        backend.use_device("cpu")


# ---------------------------------------------------------------- out of memory


@pytest.mark.parametrize("message", [METAL_OOM, "[cuda] cudaMalloc failed: out of memory",
                                     "[malloc] Unable to allocate 17179869184 bytes."])
def test_training_out_of_memory_is_one_error_line_naming_what_takes_less(work, monkeypatch, tmp_path, message):
    Metal(monkeypatch)
    calls = []
    real_call = Stepper.__call__

    def step(self, batches):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError(message)
        return real_call(self, batches)

    monkeypatch.setattr(Stepper, "__call__", step)
    run = tmp_path / "run"
    code, out, err = _cli("train", "--model", work["model"], "--data", work["data"], "--out", str(run),
                          "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "0",
                          "--save-every", "1")
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err
    assert last.startswith("error: out of memory while training") and message.split(":")[0] in last
    for fix in ("--batch-size 2 --grad-accum 2", "--grad-checkpoint", "--qlora on"):
        assert fix in last
    assert (run / "checkpoints" / "step_1").is_dir()  # what was written before is kept


def test_another_runtime_error_stays_an_internal_error(work, monkeypatch, tmp_path):
    """Control: an error that is not MLX running out of memory keeps its traceback and exit 1."""
    monkeypatch.setattr(Stepper, "__call__", lambda self, batches: (_ for _ in ()).throw(RuntimeError("boom")))
    code, _, err = _cli("train", "--model", work["model"], "--data", work["data"], "--out",
                        str(tmp_path / "run"), "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                        "--eval-every", "0")
    assert code == 1 and "Traceback" in err and "boom" in err


def test_generate_out_of_memory_is_one_error_line(work, monkeypatch):
    Metal(monkeypatch)

    def out_of_memory(*args, **kw):
        yield from ()
        raise RuntimeError(METAL_OOM)

    monkeypatch.setattr(generate_command, "stream_generate", out_of_memory)
    code, out, err = _cli("generate", "--model", work["model"], "--prompt", "12+1", "--max-tokens", "2")
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"error: out of memory while generating ({METAL_OOM}); try --quantized on (the base kept "
        f"quantized), or a smaller --max-tokens (a shorter cache)")


# ---------------------------------------------------------------- the quantization policy


@pytest.fixture
def policy(monkeypatch):
    """The policy replaced by a recorder that answers 8-bit (a plan no rule would pick for these
    float32 models: auto keeps them dense here), and what each caller asked."""
    asked = []
    answer = QuantPlan(bits=8, group_size=32)

    def quant_plan(base, mode="auto", **kw):
        asked.append((base, mode, kw))
        return answer

    monkeypatch.setattr(loading, "quant_plan", quant_plan)
    monkeypatch.setattr(job, "quant_plan", quant_plan)
    monkeypatch.setattr(inference, "quant_plan", quant_plan)
    return asked


def _quantized_layouts(model) -> set[tuple[int, int]]:
    return {(m.bits, m.group_size) for _, m in model.named_modules() if isinstance(m, QUANTIZED_TYPES)}


def test_train_asks_the_policy(work, policy, monkeypatch, tmp_path):
    built = []
    real_build = job.build_model

    def build_model(cfg, **kw):
        built.append(real_build(cfg, **kw))
        return built[-1]

    monkeypatch.setattr(job, "build_model", build_model)
    code, _, err = _cli("train", "--model", work["model"], "--data", work["data"], "--out",
                        str(tmp_path / "run"), "--steps", "1", "--batch-size", "2", "--seq-len", "32",
                        "--eval-every", "0", "--qlora", "on")
    assert code == 0, err
    assert policy == [(work["model"], "on", {"plan": QuantPlan()})]
    assert _quantized_layouts(built[0][0]) == {(8, 32)}  # the model that trained is the policy's


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_ask_the_policy(work, policy, monkeypatch, command):
    used = []
    real_load = inference.load

    def load(*args, **kw):
        model, tokenizer = real_load(*args, **kw)
        used.append(model)
        return model, tokenizer

    monkeypatch.setattr(inference, "load", load)
    args = ["--prompt", "12+1"] if command == "generate" else []
    code, _, err = _cli(command, "--model", work["model"], "--max-tokens", "2", "--quantized", "off", *args,
                        stdin="12+1\n")
    assert code == 0, err
    assert policy == [(work["model"], "off", {"run": None, "inference": True})]
    assert _quantized_layouts(used[0]) == {(8, 32)}  # the model that ran is the policy's


def test_the_tui_chat_asks_the_policy(work, policy):
    generator = Generator()
    generator.load(Source("tiny", work["model"]))
    assert policy == [(work["model"], "auto", {"run": None, "inference": True})]
    assert _quantized_layouts(generator.model) == {(8, 32)}
