"""Module-level compiled functions that can be traced again from scratch.

MLX keeps a compiled function's traces while the function object lives, and a trace made on a
thread holds arrays of that thread's stream: one that outlives the thread (the server's engine
thread) aborts the process at exit. `compiled` is `mx.compile` for functions defined at module
level; `forget_compiled()`, called by a thread that traced before it ends, drops every such
function's traces (the next call traces again) so none outlives its stream.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

_ALL: list["Compiled"] = []


class Compiled:
    def __init__(self, fn: Callable[..., Any], **options: Any):
        self.fn, self.options = fn, options
        self.traced = mx.compile(fn, **options)
        _ALL.append(self)

    def __call__(self, *args: Any) -> Any:
        return self.traced(*args)

    def forget(self) -> None:
        self.traced = mx.compile(self.fn, **self.options)


def compiled(fn: Callable[..., Any] | None = None, **options: Any):
    """`mx.compile(fn, **options)` as a `Compiled` (usable as @compiled or @compiled(shapeless=True))."""
    if fn is None:
        return lambda f: Compiled(f, **options)
    return Compiled(fn, **options)


def forget_compiled() -> None:
    """Drop the traces of every `compiled` function (see the module docstring)."""
    for c in _ALL:
        c.forget()
