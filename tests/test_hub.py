"""Models and datasets by Hugging Face id, from a local HF cache with HF_HUB_OFFLINE=1.

The cache is laid out here as huggingface_hub writes it (tests/helpers_hub.py); every command
runs through the CLI in a subprocess with HF_HOME pointing at it, and its output is compared
with the same command on the local folder the repo was made from.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import yaml

from helpers_export import tiny_model
from helpers_hub import folder_files, hub_repo, offline_env
from helpers_train import qa_rows, run_cli, write_tiny_model_folder
from mlxtoy.export import export_model
from mlxtoy.io.hub import HubRef, hub_error, parse_id

README = """---
configs:
- config_name: default
  default: true
  data_files:
  - split: train
    path: data/train-*.parquet
  - split: validation
    path: data/validation-*.parquet
  - split: test
    path: data/test-*.parquet
- config_name: chat
  data_files:
  - split: train
    path: chat/train.parquet
---
# acme/qa: add one to a number
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    import datasets

    d = tmp_path_factory.mktemp("hub")
    home = str(d / "hf")
    main = write_tiny_model_folder(str(d / "tiny"), seed=0)
    v2 = write_tiny_model_folder(str(d / "tiny-v2"), seed=1)
    hub_repo(home, "acme/tiny", folder_files(main))
    hub_repo(home, "acme/tiny", folder_files(v2), revision="v2")
    f32 = export_model(tiny_model("llama_gqa"), None, str(d / "tiny-f32.gguf"), "gguf", "f32")
    hub_repo(home, "acme/tiny-gguf", {"tiny-f32.gguf": f32, "README.md": b"GGUF only\n"})

    def completion(rows):
        return datasets.Dataset.from_list([{"prompt": r["messages"][0]["content"],
                                            "completion": r["messages"][1]["content"], "id": i}
                                           for i, r in enumerate(rows)])

    files = {"README.md": README.encode()}
    for split, n, seed in (("train", 24, 0), ("validation", 4, 1), ("test", 3, 2)):
        path = str(d / f"{split}.parquet")
        completion(qa_rows(n, seed)).to_parquet(path)
        files[f"data/{split}-00000-of-00001.parquet"] = path
    chat = str(d / "chat.parquet")
    datasets.Dataset.from_list(qa_rows(10, 3)).to_parquet(chat)
    files["chat/train.parquet"] = chat
    hub_repo(home, "acme/qa", files, kind="dataset")
    return {"home": home, "env": offline_env(home), "main": main, "v2": v2, "dir": d}


def cli(hub, *args):
    return run_cli(*args, env=hub["env"])


def one_error_line(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_inspect_and_generate_by_id(hub):
    by_id = cli(hub, "inspect", "acme/tiny", "--json")
    local = cli(hub, "inspect", hub["main"], "--json")
    assert by_id.returncode == 0 and local.returncode == 0, by_id.stderr + local.stderr
    a, b = json.loads(by_id.stdout), json.loads(local.stdout)
    assert os.path.realpath(a.pop("source")).startswith(os.path.realpath(hub["home"]))
    b.pop("source")
    assert a == b
    gen = ["--prompt", "12+1", "--max-tokens", "12"]
    r_id, r_local = cli(hub, "generate", "--model", "acme/tiny", *gen), cli(hub, "generate", "--model", hub["main"], *gen)
    assert r_id.returncode == 0 and r_id.stdout == r_local.stdout and r_id.stdout
    # a revision is its own snapshot: the v2 weights, not main's
    r_v2 = cli(hub, "generate", "--model", "acme/tiny@v2", *gen)
    assert r_v2.returncode == 0 and r_v2.stdout == cli(hub, "generate", "--model", hub["v2"], *gen).stdout
    v2 = json.loads(cli(hub, "inspect", "acme/tiny@v2", "--json").stdout)
    main_snap = os.path.basename(a and json.loads(by_id.stdout)["source"])
    assert os.path.basename(v2["source"]) != main_snap


def test_gguf_in_a_repo_by_id(hub):
    r = cli(hub, "inspect", "acme/tiny-gguf/tiny-f32.gguf", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "gguf"
    # a GGUF-only repo named without its file: one line saying how to name it
    err = one_error_line(cli(hub, "inspect", "acme/tiny-gguf"))
    assert "acme/tiny-gguf/FILE.gguf" in err


def test_missing_ids_fail_with_one_line(hub):
    err = one_error_line(cli(hub, "inspect", "acme/nope"))
    assert "acme/nope" in err and "HF_HUB_OFFLINE" in err
    err = one_error_line(cli(hub, "generate", "--model", "acme/tiny@v9", "--prompt", "x"))
    assert "acme/tiny@v9" in err
    out = hub["dir"] / "never"
    err = one_error_line(cli(hub, "train", "--model", "acme/tiny", "--data", "acme/nope-data",
                             "--out", str(out), "--steps", "1"))
    assert "acme/nope-data" in err and not out.exists()
    err = one_error_line(cli(hub, "train", "--model", "acme/tiny", "--data", "acme/qa", "--data-subset",
                             "nope", "--out", str(out), "--steps", "1"))
    assert "no subset 'nope'" in err and "default, chat" in err and not out.exists()
    err = one_error_line(cli(hub, "train", "--model", "acme/tiny", "--data", "acme/qa", "--data-split",
                             "nope", "--out", str(out), "--steps", "1"))
    assert "no split 'nope'" in err and "train, validation, test" in err


def test_train_and_export_by_id(hub, tmp_path):
    run = tmp_path / "run"
    r = cli(hub, "train", "--model", "acme/tiny", "--data", "acme/qa", "--out", str(run), "--steps", "2",
            "--batch-size", "2", "--seq-len", "64", "--eval-every", "0", "--save-every", "0")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"] == "acme/tiny" and cfg["data"] == "acme/qa"
    # the dataset's own splits: 24 train, the 4 validation rows, the 3 test rows
    assert cfg["run"]["data"]["train_examples"] == 24
    assert cfg["run"]["data"]["valid_examples"] == 4 and cfg["run"]["data"]["test_examples"] == 3
    # the run's base is found again by id (offline) for generation and export
    assert cli(hub, "generate", "--model", str(run), "--prompt", "12+1", "--max-tokens", "4").returncode == 0
    by_id, local = str(tmp_path / "id.gguf"), str(tmp_path / "local.gguf")
    assert cli(hub, "export", "acme/tiny", "--out", by_id, "--dtype", "f16").returncode == 0
    assert cli(hub, "export", hub["main"], "--out", local, "--dtype", "f16").returncode == 0
    ta = {t.name: t for t in gguf.GGUFReader(by_id).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(local).tensors}
    assert set(ta) == set(tb) and len(ta) > 10
    for name in ta:
        assert np.array_equal(np.asarray(ta[name].data), np.asarray(tb[name].data)), name
    r = cli(hub, "export", str(run), "--out", str(tmp_path / "run.gguf"))
    assert r.returncode == 0, r.stderr


def test_dataset_subset_by_id(hub, tmp_path):
    run = tmp_path / "chat"
    r = cli(hub, "train", "--model", "acme/tiny", "--data", "acme/qa", "--data-subset", "chat",
            "--out", str(run), "--steps", "1", "--batch-size", "2", "--seq-len", "64", "--eval-every", "0",
            "--save-every", "0", "--valid-fraction", "0.2")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["data_subset"] == "chat"
    # the chat subset: 10 conversations, no validation split, so 20% held out
    assert cfg["run"]["data"]["train_examples"] == 8 and cfg["run"]["data"]["valid_examples"] == 2
    assert cfg["run"]["data"]["test_examples"] == 0


def test_parse_id_shapes():
    assert parse_id("Qwen/Qwen3-0.6B") == HubRef("Qwen/Qwen3-0.6B")
    assert parse_id("Qwen/Qwen3-0.6B@refs/pr/1") == HubRef("Qwen/Qwen3-0.6B", "refs/pr/1")
    assert parse_id("org/name/sub/m-Q4_K_M.gguf@v1") == HubRef("org/name", "v1", "sub/m-Q4_K_M.gguf")
    for not_an_id in ("./a/b", "/a/b", "~/a/b", "a/b/c", "a--b/c", "name", "a/b/c.safetensors", "-a/b"):
        assert parse_id(not_an_id) is None, not_an_id


def test_hub_errors_say_what_to_do(monkeypatch):
    """Each huggingface_hub failure the network can produce (not reachable from these offline
    tests) becomes one line naming the cause and the way out."""
    import importlib

    import huggingface_hub.constants
    from huggingface_hub import errors as E

    http = importlib.import_module(E.Response.__module__.split(".")[0])

    def response(code):
        return http.Response(code, request=http.Request("GET", "https://huggingface.co/api/models/acme/x"))

    ref = HubRef("acme/x", "v9", None)
    cases = [
        (E.GatedRepoError("gated", response=response(403)), "model", "acme/x is a gated model: accept its terms at "
         "https://huggingface.co/acme/x, then log in with `hf auth login` or set HF_TOKEN"),
        (E.RepositoryNotFoundError("nf", response=response(404)), "dataset",
         "no such local path, and no dataset acme/x on the Hugging Face Hub (private? log in"),
        (E.RevisionNotFoundError("rev", response=response(404)), "model", "acme/x has no revision 'v9'"),
        (E.DisabledRepoError("off", response=response(403)), "model", "acme/x is disabled"),
    ]
    for err, kind, expected in cases:
        msg = str(hub_error(err, ref, kind))
        assert msg.startswith("acme/x@v9: ") and expected in msg and "\n" not in msg, msg
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    msg = str(hub_error(E.LocalEntryNotFoundError("x"), ref, "model"))
    assert "cannot be reached" in msg and "check the network" in msg
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE=1" in str(hub_error(E.LocalEntryNotFoundError("x"), ref, "model"))
