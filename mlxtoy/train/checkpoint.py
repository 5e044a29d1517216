"""Checkpoint and final-result tensors: what the trainer writes into a run directory.

The layout and the atomic folder come from mlxtoy.rundir; this module puts MLX arrays in them
(trainable weights, optimizer state) and reads them back for resume. Loading a run as a model
(for generate, chat, export, taps) is mlxtoy.loading's job.
"""

from __future__ import annotations

import json
import os
import struct

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path

from mlxtoy.config import TrainConfig
from mlxtoy.errors import UserError
from mlxtoy.fsutil import atomic_path, write_text_atomic
from mlxtoy.io.tokenizer import Tokenizer
from mlxtoy.models.lora import lora_parameters
from mlxtoy.rundir import (ADAPTER_CONFIG, ADAPTERS, CKPT_OBJECTIVE, CKPT_OPTIMIZER, CKPT_STATE, CKPT_TRAINABLE,
                           MODEL_CONFIG, MODEL_WEIGHTS, REFERENCE_LOGPS, CheckpointState, RunDir, RunFacts)


def save_safetensors_atomic(path: str, tensors: dict[str, mx.array],
                            metadata: dict[str, str] | None = None) -> None:
    with atomic_path(path, suffix=".safetensors") as tmp:  # mx.save_safetensors wants the suffix
        mx.save_safetensors(tmp, tensors, metadata=metadata or {})


def save_checkpoint(run: RunDir, state: CheckpointState, trainable: dict[str, mx.array],
                    optimizer_state: dict[str, mx.array], keep: int = 0,
                    objective_state: tuple[dict[str, mx.array], dict[str, str]] | None = None) -> str:
    """checkpoints/step_N, complete or absent (see RunDir.new_checkpoint); keeps the newest
    `keep` checkpoints (0: all). `objective_state`: the objective's arrays and metadata, when
    it has state of its own. Returns its path."""
    if run.read_only:  # a data-parallel rank > 0: rank 0 writes
        return run.checkpoint_path(state.step)
    with run.new_checkpoint(state.step) as tmp:
        mx.save_safetensors(os.path.join(tmp, CKPT_TRAINABLE), trainable)
        mx.save_safetensors(os.path.join(tmp, CKPT_OPTIMIZER), optimizer_state)
        if objective_state is not None:
            mx.save_safetensors(os.path.join(tmp, CKPT_OBJECTIVE), *objective_state)
        with open(os.path.join(tmp, CKPT_STATE), "w", encoding="utf-8") as f:
            json.dump(state.__dict__, f, indent=1)
    run.prune_checkpoints(keep)
    return run.checkpoint_path(state.step)


def save_best(run: RunDir, state: CheckpointState, trainable: dict[str, mx.array]) -> str:
    """RUN/best: these weights (a new lowest validation loss), complete or the previous best."""
    if run.read_only:
        return run.best_path
    with run.new_best() as tmp:
        mx.save_safetensors(os.path.join(tmp, CKPT_TRAINABLE), trainable)
        with open(os.path.join(tmp, CKPT_STATE), "w", encoding="utf-8") as f:
            json.dump(state.__dict__, f, indent=1)
    return run.best_path


def safetensors_shapes(path: str) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors header, after checking that the file holds
    every byte the header promises (a truncated file is caught without reading the data)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if not 0 < n <= min(size - 8, 100 * 2**20):
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"{path}: unreadable ({e})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: unreadable (bad header)")
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise UserError(f"{path}: truncated ({size} of {8 + n + end} bytes)")
    return {k: list(v["shape"]) for k, v in header.items()}


def checkpoint_problem(ckpt: str, trainable: dict[str, tuple[int, ...]]) -> str | None:
    """Why checkpoint `ckpt` cannot resume a model whose trainable weights have these shapes
    (None when it can): its state, its files, and every tensor's name and shape."""
    try:
        CheckpointState.read(ckpt)
        saved = safetensors_shapes(os.path.join(ckpt, CKPT_TRAINABLE))
        safetensors_shapes(os.path.join(ckpt, CKPT_OPTIMIZER))
    except UserError as e:
        return str(e)
    want = {k: list(v) for k, v in trainable.items()}
    if set(saved) != set(want):
        missing, extra = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
        return f"{ckpt}: holds other weights than the model trains (missing {missing[:3]}, extra {extra[:3]})"
    bad = [k for k in want if saved[k] != want[k]]
    if bad:
        return f"{ckpt}: {bad[0]} has shape {saved[bad[0]]}, the model's is {want[bad[0]]}"
    return None


def pick_checkpoint(run: RunDir, model) -> tuple[str | None, list[str]]:
    """The newest checkpoint that can resume `model`, and a note for each newer one that
    could not (damaged or written for another model)."""
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.trainable_parameters())}
    notes = []
    for _, ckpt in reversed(run.checkpoints()):
        problem = checkpoint_problem(ckpt, shapes)
        if problem is None:
            if notes:
                notes.append(f"resuming from the newest intact checkpoint, {ckpt}")
            return ckpt, notes
        notes.append(f"skipping a checkpoint that cannot be used: {problem}")
    return None, notes


def load_checkpoint(path: str) -> tuple[CheckpointState, dict[str, mx.array], dict[str, mx.array]]:
    state = CheckpointState.read(path)
    try:
        trainable = mx.load(os.path.join(path, CKPT_TRAINABLE))
        opt = mx.load(os.path.join(path, CKPT_OPTIMIZER))
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{path}: unreadable checkpoint ({e})") from None
    return state, trainable, opt


def load_objective_state(path: str) -> tuple[dict[str, mx.array], dict[str, str]] | None:
    """The objective's own state in checkpoint `path` (None when it kept none)."""
    file = os.path.join(path, CKPT_OBJECTIVE)
    if not os.path.exists(file):
        return None
    try:
        return mx.load(file, return_metadata=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{file}: unreadable ({e})") from None


def save_reference(run: RunDir, logps: dict[str, np.ndarray]) -> None:
    """DPO's reference log-probs per split ({"train": (pairs, 2), ...}), written once."""
    if not run.read_only:
        save_safetensors_atomic(run.join(REFERENCE_LOGPS), {k: mx.array(v) for k, v in logps.items()},
                                {"format": "mlxtoy-reference-logps"})


def load_reference(run: RunDir, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    """The stored reference log-probs (None when there are none); refused when they do not
    fit the data (`shapes`: what each split needs)."""
    path = run.join(REFERENCE_LOGPS)
    if not os.path.exists(path):
        return None
    try:
        got = {k: np.array(v) for k, v in mx.load(path).items()}
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{path}: unreadable ({e})") from None
    for k, shape in shapes.items():
        if k not in got or got[k].shape != tuple(shape):
            raise UserError(f"{path}: holds reference log-probs for other data ({k}: "
                            f"{got[k].shape if k in got else 'none'}, the data has {tuple(shape)})")
    return got


def flat_optimizer_state(optimizer) -> dict[str, mx.array]:
    return dict(tree_flatten(optimizer.state))


def restore_optimizer_state(optimizer, flat: dict[str, mx.array], source: str) -> None:
    """Put saved values into an initialised optimizer state, leaf by leaf (same tree)."""

    def pick(path: str, value):
        if path not in flat:
            raise UserError(f"{source}: optimizer state has no {path}")
        if hasattr(value, "shape") and tuple(flat[path].shape) != tuple(value.shape):
            raise UserError(f"{source}: optimizer state {path} has shape {list(flat[path].shape)}, "
                            f"expected {list(value.shape)}")
        return flat[path]

    optimizer.state = tree_map_with_path(pick, optimizer.state)


def write_final(run: RunDir, cfg: TrainConfig, model, tokenizer, facts: RunFacts, step: int) -> str | None:
    """adapters.safetensors (+ adapter_config.json) for LoRA / DoRA, or model.safetensors
    (+ model_config.json)."""
    if run.read_only:
        return None
    if cfg.adapters:
        info = dict(facts.lora or {}, method=cfg.method, base_model=cfg.model,
                    base_model_path=facts.model_path, step=step)
        save_safetensors_atomic(run.join(ADAPTERS), lora_parameters(model), {"format": "mlxtoy-lora"})
        write_text_atomic(run.join(ADAPTER_CONFIG), json.dumps(info, indent=2))
        return run.join(ADAPTERS)
    weights = dict(tree_flatten(model.parameters()))
    save_safetensors_atomic(run.join(MODEL_WEIGHTS), weights, {"format": "mlxtoy"})
    info = {"method": cfg.method, "step": step, "model_config": model.config.to_dict(),
            "base_model": cfg.model if cfg.method == "full" else None,
            "tokenizer": cfg.tokenizer or cfg.model}
    write_text_atomic(run.join(MODEL_CONFIG), json.dumps(info, indent=2))
    if cfg.method == "scratch" and isinstance(tokenizer, Tokenizer):  # a char vocabulary lives in config.yaml
        write_text_atomic(run.join("tokenizer.json"), tokenizer.to_hf_tokenizer_json())
        write_text_atomic(run.join("tokenizer_config.json"),
                          json.dumps(tokenizer.to_hf_tokenizer_config(), indent=2))
    return run.join(MODEL_WEIGHTS)
