"""The registry: architecture name -> `ArchSpec`, and the lookups the readers, writers and the
assembly layer use (by name, by a GGUF's `general.architecture`, by an HF config.json), plus
`expected_shapes`, read off the lazily built module."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxtoy.arch import gemma3, gpt2, llama, mistral, phi3, qwen2, qwen3, tiny
from mlxtoy.arch.spec import ArchSpec
from mlxtoy.errors import UserError
from mlxtoy.model_config import SUPPORTED_ARCHS, ModelConfig

SPECS: dict[str, ArchSpec] = {s.name: s for s in (llama.SPEC, qwen2.SPEC, qwen3.SPEC, mistral.SPEC, phi3.SPEC,
                                                    gemma3.SPEC, gpt2.SPEC, tiny.SPEC)}
assert tuple(SPECS) == SUPPORTED_ARCHS, "model_config.SUPPORTED_ARCHS and the registered specs differ"


def spec_of(arch: str, where: str = "") -> ArchSpec:
    spec = SPECS.get(arch)
    if spec is None:
        raise UserError(f"{where + ': ' if where else ''}unknown architecture {arch!r} "
                        f"(supported: {', '.join(SPECS)})")
    return spec


def spec_for_gguf(md: dict[str, Any], where: str) -> ArchSpec:
    """The spec that reads a GGUF whose `general.architecture` is in `md`."""
    arch = md.get("general.architecture")
    spec = SPECS.get(arch)
    if spec is None or spec.gguf_arch != arch:
        known = [s.gguf_arch for s in SPECS.values() if s.gguf_arch == s.name]
        raise UserError(f"{where}: unknown architecture {arch!r} (supported: {', '.join(known)})")
    return spec


def spec_for_hf(raw: dict[str, Any], where: str) -> ArchSpec:
    """The spec that reads a config.json: by `architectures`, else by `model_type`."""
    classes = raw.get("architectures") or []
    for spec in SPECS.values():
        if any(c in spec.hf_classes for c in classes):
            return spec
    for spec in SPECS.values():
        if raw.get("model_type") in spec.hf_model_types:
            return spec
    known = [c for s in SPECS.values() for c in s.hf_classes]
    raise UserError(f"{where}: unknown architecture {classes or raw.get('model_type')!r} "
                    f"(supported: {', '.join(known)})")


def build_module(cfg: ModelConfig):
    """The (lazily initialised) module for `cfg`: nothing is computed until evaluated."""
    return spec_of(cfg.arch).model(cfg)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape, for every weight the model needs (from the module itself).

    Building draws the (never evaluated) initial weights from MLX's global RNG; its key is put
    back so reading or writing a file never changes what a seeded run draws next."""
    hi, lo = (int(x) for x in mx.random.state[0].tolist())
    try:
        return {k: tuple(v.shape) for k, v in tree_flatten(build_module(cfg).parameters())}
    finally:
        mx.random.seed((hi << 32) | lo)
