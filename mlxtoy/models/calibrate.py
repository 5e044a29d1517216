"""This machine's routes measured for a model's shapes up front (`mlxtoy doctor --calibrate`),
instead of when a training step or a prompt first meets each shape (`fastmath.gemm_route`,
`attention.attention_route`), and the table of what was measured."""

from __future__ import annotations

from dataclasses import dataclass

from mlxtoy.config import ModelConfig
from mlxtoy.models.attention import attention_route
from mlxtoy.models.fastmath import gemm_on, gemm_route, route_table


@dataclass(frozen=True)
class BlockShapes:
    """The dimensions that decide a transformer block's products and attention."""

    name: str
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    d_head: int

    @staticmethod
    def of(cfg: ModelConfig, name: str = "model") -> "BlockShapes":
        return BlockShapes(name, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.d_head)

    def matrices(self) -> list[tuple[int, int]]:
        """(outputs, inputs) of q, k/v, o, gate/up and down."""
        d, q, kv = self.d_model, self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        return [(q, d), (kv, d), (d, q), (self.d_ff, d), (d, self.d_ff)]


# what `doctor --calibrate` measures: the built-in model's shapes and a 1B model's
REFERENCE_SHAPES = (BlockShapes("SmolLM2-135M", 576, 1536, 9, 3, 64),
                    BlockShapes("Llama-3.2-1B", 2048, 8192, 32, 8, 64))


def calibrate(shapes: BlockShapes, batch: int, seq_len: int, training: bool) -> None:
    """Measure (where not yet measured) the routes of a step of `batch` rows of `seq_len`
    tokens through blocks of these shapes: each product's forward, with `training` its input
    gradient too, and the attention."""
    rows = batch * seq_len
    if gemm_on():
        for n_out, k_in in shapes.matrices():
            gemm_route("nt", rows, n_out, k_in)
            if training:
                gemm_route("nn", rows, k_in, n_out)
    attention_route(batch, shapes.n_heads, shapes.n_kv_heads, seq_len, seq_len, shapes.d_head, training)


def measured() -> list[dict]:
    """Every route measured on this machine (the cache), as rows for `doctor`."""
    table = route_table()
    return [{"work": key, "route": choice.route,
             "gflops": {name: (None if rate is None else round(rate, 1)) for name, rate in choice.gflops.items()},
             "seconds": round(choice.seconds, 3)}
            for key, choice in sorted(table.choices.items())]
