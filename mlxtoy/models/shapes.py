"""Every weight a model needs, by name and shape: the one table readers and writers check against.

Our parameter names are the module paths of the model tree (`layers.3.attn.q.weight`); each
architecture's table lives beside its module (`mlxtoy.models.llama.llama_shapes`,
`mlxtoy.models.gpt2.learned_pos_shapes`) and `expected_shapes` picks by `cfg.arch`.
"""

from __future__ import annotations

from mlxtoy.config import ModelConfig
from mlxtoy.models.gpt2 import LEARNED_POS_ARCHS, learned_pos_shapes
from mlxtoy.models.llama import llama_shapes


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape, for every weight the model needs."""
    if cfg.arch in LEARNED_POS_ARCHS:  # gpt2, tiny: learned positions (mlxtoy.models.gpt2)
        return learned_pos_shapes(cfg)
    return llama_shapes(cfg)
