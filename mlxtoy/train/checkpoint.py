"""Run directories: config, metrics, atomic checkpoints, the final result, and loading them back.

Layout of a run directory:

    RUN/
      config.yaml            the fully resolved TrainConfig (usable as --config), plus `run:`
                             (resolved base model path, model config, LoRA layout, versions)
      metrics.jsonl          one event per line (mlxtoy.events), appended as training goes
      checkpoints/
        step_N/              complete or absent: written to a temp folder, then renamed
          trainable.safetensors   adapters (lora) or the trainable weights (full, scratch)
          optimizer.safetensors   AdamW state (step, moments), flattened names
          state.json              step, data position, RNG key, elapsed time, tokens seen
      adapters.safetensors + adapter_config.json     final result of a LoRA run
      model.safetensors + model_config.json          final result of a full / scratch run
      tokenizer.json + tokenizer_config.json         scratch runs: the tokenizer used

Loading: `load_run_model(RUN)` -> (model, tokenizer) from the final result, or from the newest
checkpoint when the run has not finished; RUN may also be one `checkpoints/step_N` folder.
`adapter_weights(RUN)` -> (adapter tensors, LoRA layout) for exporters.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path

from mlxtoy.config import ModelConfig, TrainConfig
from mlxtoy.errors import UserError

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
ADAPTERS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"
RUN_MARKERS = (CONFIG, METRICS, CHECKPOINTS, ADAPTERS, MODEL_WEIGHTS)

# Tests set this to make the writer pause between files, so a kill lands mid-write.
_WRITE_DELAY_ENV = "MLXTOY_CKPT_WRITE_DELAY"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_bytes_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: str, text: str) -> None:
    _write_bytes_atomic(path, text.encode("utf-8"))


def save_safetensors_atomic(path: str, tensors: dict[str, mx.array], metadata: dict[str, str] | None = None) -> None:
    base, _ = os.path.splitext(path)
    tmp = f"{base}.tmp-{os.getpid()}.safetensors"  # mx.save_safetensors wants the suffix
    mx.save_safetensors(tmp, tensors, metadata=metadata or {})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _is_run_dir(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in RUN_MARKERS)


@dataclass
class CheckpointState:
    """What a checkpoint restores besides tensors."""

    step: int
    data_position: int  # global index of the next training batch
    rng: list[int]  # mx.random key [hi, lo]
    elapsed: float = 0.0
    tokens_seen: int = 0


class RunDir:
    def __init__(self, path: str):
        if not path:
            raise UserError("no output folder (--out RUN)")
        self.path = os.path.abspath(path)

    # ---- paths
    def join(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    @property
    def metrics_path(self) -> str:
        return self.join(METRICS)

    @property
    def checkpoints_dir(self) -> str:
        return self.join(CHECKPOINTS)

    # ---- lifecycle
    def is_run(self) -> bool:
        return _is_run_dir(self.path)

    def check_fresh(self) -> None:
        """Refuse a folder that already holds a run (nothing of it must be overwritten)."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise UserError(f"{self.path}: exists and is not a folder")
        if self.is_run():
            raise UserError(f"{self.path}: already holds a training run; choose another --out "
                            f"or continue it with --resume {self.path}")

    def create(self, cfg: TrainConfig, resolved: dict[str, Any]) -> None:
        os.makedirs(self.checkpoints_dir, exist_ok=True)
        self.write_config(cfg, resolved)

    def write_config(self, cfg: TrainConfig, resolved: dict[str, Any]) -> None:
        import yaml

        data = cfg.to_dict()
        data["run"] = resolved
        write_text_atomic(self.join(CONFIG), yaml.safe_dump(data, sort_keys=False))

    def read_config(self) -> tuple[TrainConfig, dict[str, Any]]:
        from mlxtoy.config import load_yaml

        path = self.join(CONFIG)
        if not os.path.exists(path):
            raise UserError(f"{self.path}: not a training run (no {CONFIG})")
        data = load_yaml(path)
        resolved = data.get("run") or {}
        return TrainConfig.from_dict(data, source=path), resolved

    # ---- metrics
    def append_event(self, line: str) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(line + "\n")

    def truncate_metrics(self, after_step: int) -> None:
        """Drop events of steps past `after_step` (a resumed run redoes them)."""
        if not os.path.exists(self.metrics_path):
            return
        kept = []
        with open(self.metrics_path) as f:
            for line in f:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    break  # a torn last line from a crash
                if obj.get("step") is not None and obj["step"] > after_step:
                    continue
                if obj.get("event") in ("done",):
                    continue
                kept.append(line if line.endswith("\n") else line + "\n")
        write_text_atomic(self.metrics_path, "".join(kept))

    # ---- checkpoints
    def checkpoints(self) -> list[tuple[int, str]]:
        """Complete checkpoints, oldest first."""
        out = []
        if os.path.isdir(self.checkpoints_dir):
            for name in os.listdir(self.checkpoints_dir):
                if name.startswith("step_") and name[5:].isdigit():
                    path = os.path.join(self.checkpoints_dir, name)
                    if os.path.exists(os.path.join(path, "state.json")):
                        out.append((int(name[5:]), path))
        return sorted(out)

    def latest_checkpoint(self) -> str | None:
        ckpts = self.checkpoints()
        return ckpts[-1][1] if ckpts else None

    def clean_partial(self) -> None:
        """Remove temp folders left by a writer that was killed."""
        if os.path.isdir(self.checkpoints_dir):
            for name in os.listdir(self.checkpoints_dir):
                if name.startswith(".tmp-") or name.startswith(".old-"):
                    shutil.rmtree(os.path.join(self.checkpoints_dir, name), ignore_errors=True)

    def save_checkpoint(self, state: CheckpointState, trainable: dict[str, mx.array],
                        optimizer_state: dict[str, mx.array], keep: int = 0) -> str:
        """Write checkpoints/step_N atomically: a temp folder, fsynced, then one rename."""
        os.makedirs(self.checkpoints_dir, exist_ok=True)
        final = os.path.join(self.checkpoints_dir, f"step_{state.step}")
        tmp = tempfile.mkdtemp(prefix=f".tmp-step_{state.step}-", dir=self.checkpoints_dir)
        try:
            mx.save_safetensors(os.path.join(tmp, "trainable.safetensors"), trainable)
            delay = float(os.environ.get(_WRITE_DELAY_ENV, "0") or 0)
            if delay:
                time.sleep(delay)  # tests: a kill now lands in the middle of the write
            mx.save_safetensors(os.path.join(tmp, "optimizer.safetensors"), optimizer_state)
            with open(os.path.join(tmp, "state.json"), "w") as f:
                json.dump(state.__dict__, f, indent=1)
            for name in os.listdir(tmp):
                with open(os.path.join(tmp, name), "rb") as f:
                    os.fsync(f.fileno())
            _fsync_dir(tmp)
            if os.path.exists(final):  # re-saving a step (e.g. after a resume): swap
                old = os.path.join(self.checkpoints_dir, f".old-step_{state.step}-{os.getpid()}")
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.checkpoints_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if keep > 0:
            for _, path in self.checkpoints()[:-keep]:
                shutil.rmtree(path, ignore_errors=True)
        return final


def load_checkpoint(path: str) -> tuple[CheckpointState, dict[str, mx.array], dict[str, mx.array]]:
    try:
        with open(os.path.join(path, "state.json")) as f:
            state = CheckpointState(**json.load(f))
        trainable = mx.load(os.path.join(path, "trainable.safetensors"))
        opt = mx.load(os.path.join(path, "optimizer.safetensors"))
    except (OSError, ValueError, TypeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable checkpoint ({e})") from None
    return state, trainable, opt


def flat_optimizer_state(optimizer) -> dict[str, mx.array]:
    return dict(tree_flatten(optimizer.state))


def restore_optimizer_state(optimizer, flat: dict[str, mx.array], source: str) -> None:
    """Put saved values into an initialised optimizer state, leaf by leaf (same tree)."""

    def pick(path: str, value):
        if path not in flat:
            raise UserError(f"{source}: optimizer state has no {path}")
        return flat[path]

    optimizer.state = tree_map_with_path(pick, optimizer.state)


# ---------------------------------------------------------------------------------------------
# Final results and loading them back
# ---------------------------------------------------------------------------------------------


def write_final(run: RunDir, cfg: TrainConfig, model, tokenizer, resolved: dict[str, Any], step: int) -> str:
    """adapters.safetensors (+ adapter_config.json), or model.safetensors (+ model_config.json)."""
    from mlxtoy.models.lora import lora_parameters

    if cfg.method == "lora":
        info = dict(resolved.get("lora") or {}, method="lora", base_model=cfg.model,
                    base_model_path=resolved.get("model_path"), step=step)
        save_safetensors_atomic(run.join(ADAPTERS), lora_parameters(model), {"format": "mlxtoy-lora"})
        write_text_atomic(run.join(ADAPTER_CONFIG), json.dumps(info, indent=2))
        return run.join(ADAPTERS)
    weights = dict(tree_flatten(model.parameters()))
    save_safetensors_atomic(run.join(MODEL_WEIGHTS), weights, {"format": "mlxtoy"})
    info = {"method": cfg.method, "step": step, "model_config": model.config.to_dict(),
            "base_model": cfg.model if cfg.method == "full" else None,
            "tokenizer": cfg.tokenizer or cfg.model}
    write_text_atomic(run.join(MODEL_CONFIG), json.dumps(info, indent=2))
    if cfg.method == "scratch" and tokenizer is not None and hasattr(tokenizer, "to_hf_tokenizer_json"):
        try:
            write_text_atomic(run.join("tokenizer.json"), tokenizer.to_hf_tokenizer_json())
            write_text_atomic(run.join("tokenizer_config.json"),
                              json.dumps(tokenizer.to_hf_tokenizer_config(), indent=2))
        except Exception:
            pass  # the tokenizer source recorded in config.yaml still works
    return run.join(MODEL_WEIGHTS)


def _locate(path: str) -> tuple[RunDir, str | None]:
    """RUN or RUN/checkpoints/step_N -> (run, checkpoint folder or None for 'best available')."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise UserError(f"{path}: no such run folder")
    if os.path.exists(os.path.join(path, "state.json")):
        return RunDir(os.path.dirname(os.path.dirname(path))), path
    run = RunDir(path)
    if not os.path.exists(run.join(CONFIG)):
        raise UserError(f"{path}: not a training run (no {CONFIG})")
    return run, None


def _run_weights(run: RunDir, cfg: TrainConfig, ckpt: str | None) -> tuple[dict[str, mx.array], str]:
    """The tensors to apply: the final result when there is one, else the newest checkpoint."""
    final = run.join(ADAPTERS if cfg.method == "lora" else MODEL_WEIGHTS)
    if ckpt is None and os.path.exists(final):
        return mx.load(final), final
    ckpt = ckpt or run.latest_checkpoint()
    if ckpt is None:
        raise UserError(f"{run.path}: the run has no result and no checkpoint yet")
    return mx.load(os.path.join(ckpt, "trainable.safetensors")), ckpt


def load_tokenizer(model_arg: str):
    """Just the tokenizer of MODEL (GGUF metadata or an HF folder); no weights read."""
    from mlxtoy.io.registry import resolve_model
    from mlxtoy.io.tokenizer import Tokenizer

    kind, path = resolve_model(model_arg)
    if kind == "gguf":
        from mlxtoy.io.gguf_read import open_gguf, read_metadata

        return Tokenizer.from_gguf_metadata(read_metadata(open_gguf(path)), source=path)
    return Tokenizer.from_hf_folder(path)


def load_run_model(run_dir: str, base: str | None = None, dtype: mx.Dtype | None = None,
                   merge: bool = True):
    """A run's model -> (model, tokenizer), in eval mode.

    lora: the base (`base`, else the run's model) with the adapters (merged by default).
    full: the run's full weights (the base supplies the tokenizer). scratch: the run's model.
    """
    from mlxtoy import backend
    from mlxtoy.loading import build_model, load_weights
    from mlxtoy.models.lora import apply_lora, merge_lora

    run, ckpt = _locate(run_dir)
    cfg, resolved = run.read_config()
    weights, source = _run_weights(run, cfg, ckpt)
    dtype = dtype or backend.compute_dtype()
    if cfg.method == "scratch":
        mcfg = ModelConfig.from_dict(resolved["model_config"])
        model = build_model(mcfg)
        if resolved.get("char_tokenizer"):  # character / byte vocabulary, kept in config.yaml
            from mlxtoy.io.char_tokenizer import CharTokenizer

            tokenizer = CharTokenizer.from_dict(resolved["char_tokenizer"])
        elif os.path.exists(run.join("tokenizer.json")):
            from mlxtoy.io.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_hf_folder(run.path)
        else:
            tokenizer = load_tokenizer(base or cfg.tokenizer or cfg.model)
        if resolved.get("lens"):  # projection lens: the donor table is read from its source again
            from mlxtoy.models.lens import attach_lens

            attach_lens(model, resolved["lens"]["donor"], tokenizer)
        meta = None
    else:
        mcfg, base_weights, meta, tokenizer = load_weights(base or cfg.model, dtype)
        model = build_model(mcfg, base_weights)
        del base_weights
        if cfg.method == "lora":
            lora = resolved.get("lora") or {}
            apply_lora(model, lora.get("targets", cfg.lora_targets), lora.get("rank", cfg.lora_rank),
                       lora.get("alpha", cfg.lora_alpha), 0.0, lora.get("per_head_q", cfg.lora_per_head_q),
                       lora.get("layers", cfg.lora_layers))
    try:
        model.load_weights(list(weights.items()), strict=False)
    except ValueError as e:
        raise UserError(f"{source}: does not fit the model ({e})") from None
    if cfg.method == "lora" and merge:
        merge_lora(model)
    if merge:  # a projection lens becomes the plain embedding table it equals
        from mlxtoy.models.lens import fold_lens

        fold_lens(model)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    model.freeze()
    model.eval()
    mx.eval(model.parameters())
    model.meta = meta
    model.run_source = source
    return model, tokenizer


def adapter_weights(run_dir: str) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """(adapter tensors named like `layers.0.attn.q.lora_a`, LoRA layout) for exporters.

    Layout keys: targets, rank, alpha, scale, dropout, per_head_q, layers, base_model,
    base_model_path, model_config, step. Shapes: q/k/v standard A (r, D), B (H*Dh, r); per-head q
    A (H, r, D), B (H, Dh, r); o/gate/up/down A (r, in), B (out, r). Delta W = scale * B @ A,
    in our (GGML adjacent-pair RoPE) row order for q/k.
    """
    run, ckpt = _locate(run_dir)
    cfg, resolved = run.read_config()
    if cfg.method != "lora":
        raise UserError(f"{run.path}: a {cfg.method} run has no adapters (it has full weights)")
    weights, source = _run_weights(run, cfg, ckpt)
    info = dict(resolved.get("lora") or {})
    info.update(base_model=cfg.model, base_model_path=resolved.get("model_path"),
                model_config=resolved.get("model_config"), source=source)
    if source.endswith(ADAPTERS) and os.path.exists(run.join(ADAPTER_CONFIG)):
        with open(run.join(ADAPTER_CONFIG)) as f:
            info["step"] = json.load(f).get("step")
    else:
        with open(os.path.join(source, "state.json")) as f:
            info["step"] = json.load(f)["step"]
    return weights, info
