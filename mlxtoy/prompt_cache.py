"""The prompt cache: the K/V of prompts already read, so a request that shares a prefix with
an earlier one (the same system prompt, the same conversation one turn on) prefills only the
rest. Entries are single-row caches keyed by (adapter slot, tokens), the least recently used
dropped first once their bytes pass the budget. A lookup takes the entry with the longest
common prefix with the new prompt (at least one prompt token is always left to read, since
the logits after it are needed) and hands back a copy trimmed to that prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import mlx.core as mx

from mlxtoy.models.cache import KVCache, cache_columns

MIN_PREFIX = 16  # a shorter common prefix is not worth the copy


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, tuple[int, ...]], list[KVCache]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0

    def fetch(self, prompt: Sequence[int], adapter: int) -> tuple[list[KVCache] | None, int]:
        """-> (a fresh cache holding the longest cached prefix of prompt[:-1], its length),
        or (None, 0)."""
        best, best_n = None, 0
        for key in self.entries:
            if key[0] != adapter:
                continue
            n = _common(key[1], prompt[:-1])
            if n > best_n:
                best, best_n = key, n
        if best is None or best_n < MIN_PREFIX:
            return None, 0
        self.entries.move_to_end(best)
        self.hits += 1
        return cache_columns(self.entries[best], 0, best_n), best_n

    def store(self, prompt: Sequence[int], adapter: int, cache: list[KVCache]) -> None:
        """Keep a copy of a single-row cache holding `prompt` (only its valid columns)."""
        key = (adapter, tuple(int(t) for t in prompt))
        if key in self.entries or len(prompt) < MIN_PREFIX:
            return
        kept = cache_columns(cache)
        mx.eval([c.state for c in kept])
        size = sum(c.nbytes for c in kept)
        if size > self.max_bytes:
            return
        # a stored prompt that this one extends is no longer needed: this covers its prefixes
        for old in [k for k in self.entries if k[0] == adapter and len(k[1]) < len(key[1])
                    and key[1][:len(k[1])] == k[1]]:
            self.nbytes -= sum(c.nbytes for c in self.entries.pop(old))
        self.entries[key] = kept
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.nbytes -= sum(c.nbytes for c in dropped)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0
