"""The projection lens: warm-start a model's token embedding from a donor table of another width.

A donor table D (vocab, d_in) (for example SmolLM2's 576-wide embeddings) stays frozen; a
trainable W_proj (d_in, d_model) maps it into the new model's width, so the embedding the
model sees is E = D @ W_proj (vocab, d_model). With a tied output the same E is the
unembedding. Export folds the lens exactly into a standard table (the seed's fold):

    embed_eff[v, r] = sum_c D[v, c] * W_proj[c, r]

`ProjectionLens` replaces `model.tok_embeddings` and behaves like nn.Embedding (call on
tokens, `as_linear`, and a read-only `weight` that is the folded table), so the model, the
trainer, generation and the exporters need not know a lens is there. Reading a donor table
from a model (`load_donor`, `attach_lens`) is assembly: `mlxtoy.loading`.

W_proj starts as the donor's top-d_model principal directions, so E keeps as much of the
donor's geometry as d_model dimensions can hold ("random": a random projection), scaled so
E starts at the from-scratch embedding scale (entries with std 0.02).

With a tied output the lens also ties the unembedding to the donor's geometry: every row of
the output moves with W_proj, so the model cannot push down the many tokens a small corpus
never uses. Measured (SmolLM2 donor, 256-wide 2-layer model, the bundled corpus, 40 steps of
4 x 64 tokens, Adam 1e-3): validation loss 2.89 with an untied output
(`--no-tie-embeddings`; a free table: 2.34), 6.54 tied (a free tied table: 4.20).

    mlxtoy train --method scratch --lens smollm2-135m --tokenizer smollm2-135m \
        --no-tie-embeddings --d-model 256 --data DATA --out RUN
    mlxtoy export RUN --out model.gguf     # the lens folded into token_embd
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxtoy.errors import UserError
from mlxtoy.models.init import EMBED_STD

LENS_INITS = ("pca", "random")


class ProjectionLens(nn.Module):
    """Token embedding = donor[tokens] @ W_proj; donor (vocab, d_in) frozen, W_proj (d_in, d_model).

    The trained array is `proj` = W_proj / gain, with `gain` a constant of the donor (1 over
    its mean row L1 norm): an optimizer step of size lr on `proj` then moves the embedding rows
    by about lr, as it would move a free table. Without it, Adam's sign-like steps on W_proj
    add up along each donor row and move E by ~lr * |row|_1, tens of times faster.
    """

    def __init__(self, donor: mx.array, d_model: int, init: str = "pca", seed: int = 0):
        super().__init__()
        if donor.ndim != 2:
            raise UserError(f"donor embedding table must be 2-D (vocab, d_in), "
                            f"got shape {list(donor.shape)}")
        self.donor = donor.astype(mx.float32)
        table = np.array(self.donor)
        self.gain = projection_gain(table)
        self.proj = initial_projection(table, d_model, init, seed) / self.gain
        self.freeze(keys=["donor"], recurse=False)

    @property
    def d_in(self) -> int:
        return self.donor.shape[1]

    @property
    def w_proj(self) -> mx.array:
        """W_proj (d_in, d_model): E = donor @ W_proj."""
        return self.proj * self.gain

    @property
    def weight(self) -> mx.array:
        """The folded [vocab, d_model] table: what a standard embedding would hold."""
        return fold(self.donor, self.w_proj)

    def __call__(self, tokens: mx.array) -> mx.array:
        return self.donor[tokens].astype(self.proj.dtype) @ self.w_proj

    def as_linear(self, h: mx.array) -> mx.array:
        # h @ E.T = (h @ W_proj.T) @ donor.T: never forms E, and d_in < vocab keeps it cheap
        return (h @ self.w_proj.T) @ self.donor.T.astype(h.dtype)


def projection_gain(donor: np.ndarray) -> float:
    """1 / (mean L1 norm of the donor's rows): the constant between `proj` and W_proj."""
    l1 = float(np.abs(donor.astype(np.float64)).sum(axis=1).mean())
    return 1.0 / l1 if l1 > 0 else 1.0


def fold(donor: mx.array, proj: mx.array) -> mx.array:
    """embed_eff[v, r] = sum_c donor[v, c] * proj[c, r], in float32."""
    return donor.astype(mx.float32) @ proj.astype(mx.float32)


def initial_projection(donor: np.ndarray, d_model: int, init: str = "pca", seed: int = 0) -> mx.array:
    if init not in LENS_INITS:
        raise UserError(f"unknown lens init {init!r} (choose from {', '.join(LENS_INITS)})")
    d_in = donor.shape[1]
    if init == "random" or d_model > d_in:
        # more output than input dimensions: no principal subspace to keep, start random
        rng = np.random.default_rng(seed)
        w = rng.standard_normal((d_in, d_model))
        std = float((donor.astype(np.float64) @ w).std())
        return mx.array((w * (EMBED_STD / std if std > 0 else 1.0)).astype(np.float32))
    centered = donor - donor.mean(axis=0, keepdims=True)
    # right singular vectors of the (vocab, d_in) table, via the small d_in x d_in covariance
    cov = centered.T.astype(np.float64) @ centered.astype(np.float64)
    _, vecs = np.linalg.eigh(cov)
    # (d_in, d_model), orthogonal columns: E's rows are the donor rows' coordinates in the
    # donor's top-d_model principal subspace, scaled so E's entries have the from-scratch
    # embedding scale (std EMBED_STD): with a tied output, a donor-scale table would start
    # the logits far too sharp
    top = vecs[:, ::-1][:, :d_model]
    std = float((donor.astype(np.float64) @ top).std())
    top = top * (EMBED_STD / std if std > 0 else 1.0)
    return mx.array(np.ascontiguousarray(top, dtype=np.float32))


def apply_lens(model: nn.Module, donor: mx.array, tokenizer=None, init: str = "pca",
               seed: int = 0, source: str = "donor") -> nn.Module:
    """Replace `model.tok_embeddings` with a ProjectionLens over `donor`. Returns the model.

    The donor's vocabulary must be the model's (and the tokenizer's, when given): the lens
    maps token ids through the donor's rows, so a different vocabulary would silently mean
    different tokens.
    """
    if not hasattr(model, "tok_embeddings") or not hasattr(model, "config"):
        raise UserError(f"a projection lens needs a model with a token embedding, got {type(model).__name__}")
    cfg = model.config
    if donor.ndim != 2:
        raise UserError(f"{source}: donor embedding table must be 2-D (vocab, d_in), "
                        f"got shape {list(donor.shape)}")
    vocab = donor.shape[0]
    if tokenizer is not None and tokenizer.vocab_size != vocab:
        raise UserError(f"{source}: the donor table has {vocab} rows but the tokenizer has "
                        f"{tokenizer.vocab_size} tokens; the lens needs the donor's own vocabulary")
    if vocab != cfg.vocab_size:
        raise UserError(f"{source}: the donor table has {vocab} rows but the model's vocabulary is "
                        f"{cfg.vocab_size}")
    if isinstance(model.tok_embeddings, ProjectionLens):
        raise UserError("the model already has a projection lens")
    model.tok_embeddings = ProjectionLens(donor, cfg.d_model, init, seed)
    mx.eval(model.tok_embeddings.parameters())
    return model


def fold_lens(model: nn.Module) -> nn.Module:
    """Replace a ProjectionLens by the standard nn.Embedding it equals (in place)."""
    lens = getattr(model, "tok_embeddings", None)
    if isinstance(lens, ProjectionLens):
        table = lens.weight
        emb = nn.Embedding(*table.shape)
        emb.weight = table
        model.tok_embeddings = emb
        mx.eval(emb.weight)
    return model


def has_lens(model: nn.Module) -> bool:
    return isinstance(getattr(model, "tok_embeddings", None), ProjectionLens)
