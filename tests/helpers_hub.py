"""Local Hugging Face caches laid out as huggingface_hub writes them (no network, ever).

    HF_HOME/hub/models--org--name/refs/main            the commit a branch / tag points to
    HF_HOME/hub/models--org--name/snapshots/<commit>/  the repo's files (symlinks into blobs/)
    HF_HOME/hub/models--org--name/blobs/<sha256>       the file contents
    (datasets--org--name/ for dataset repos)
"""

from __future__ import annotations

import hashlib
import os


def hub_repo(hf_home: str, repo_id: str, files: dict[str, str | bytes], kind: str = "model",
             revision: str = "main") -> str:
    """Put `files` ({path in repo: local file path or bytes}) into the cache as one commit of
    `repo_id` that `revision` points to; -> the snapshot folder."""
    root = os.path.join(hf_home, "hub", f"{kind}s--{repo_id.replace('/', '--')}")
    contents = {}
    for rel, src in sorted(files.items()):
        if isinstance(src, str):
            with open(src, "rb") as f:
                src = f.read()
        contents[rel] = src
    commit = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in contents.items()))
                          .encode()).hexdigest()
    snap = os.path.join(root, "snapshots", commit)
    for rel, data in contents.items():
        digest = hashlib.sha256(data).hexdigest()
        blob = os.path.join(root, "blobs", digest)
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(snap, rel)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", revision), "w") as f:
        f.write(commit)  # no newline, as huggingface_hub writes it
    return snap


def folder_files(folder: str) -> dict[str, str]:
    """{relative path: absolute path} of every file under `folder`."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, folder)] = p
    return out


def offline_env(hf_home: str) -> dict[str, str]:
    return {"HF_HOME": hf_home, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": os.path.join(hf_home, "hub"),
            "HF_DATASETS_CACHE": os.path.join(hf_home, "datasets")}


