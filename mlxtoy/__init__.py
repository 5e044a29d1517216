"""mlxtoy: on-device LLM fine-tuning on MLX.

Importing this package sets up the backend (an optimized BLAS on Linux CPU) before
`mlx.core` is first used, so the Python API is fast too.
"""

from mlxtoy import backend  # noqa: F401  (must run before mlx.core is imported elsewhere)
from mlxtoy import settings
from mlxtoy.errors import UserError

__version__ = "0.1.0"


def load(model: str, adapter: str | None = None):
    """Load MODEL (a .gguf file, a Hugging Face folder or id, or a built-in name) ->
    (model, tokenizer).

    `adapter` is a run directory whose adapters or weights are applied on top.
    """
    # deferred: `import mlxtoy` stays light and sets up the backend before anything else
    from mlxtoy import loading

    settings.check_all()  # a wrong MLXTOY_* value is refused here, as the CLI refuses it
    return loading.load(model, adapter=adapter)


__all__ = ["load", "UserError", "backend"]
