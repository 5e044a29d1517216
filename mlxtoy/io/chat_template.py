"""Chat templates: jinja2 templates from model files, rendered in a strict sandbox.

- `ChatTemplate`: one template, compiled on first use; `render` turns messages into the prompt
  text, and any failure (syntax, sandbox violation, `raise_exception`) into a UserError;
- `CHATML_TEMPLATE`: what a tokenizer without a template of its own renders with;
- the sandbox gives templates the helpers transformers does (`raise_exception`,
  `strftime_now`, a `tojson` that keeps non-ASCII text, the `{% generation %}` block) and
  nothing else.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from datetime import datetime
from typing import Any

from jinja2 import Template, nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from mlxtoy.errors import UserError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# A template comes from a downloaded file: bound what one render may cost.
RENDER_SECONDS = 10.0
MAX_OUTPUT_CHARS = 16 * 2**20  # beyond any prompt a model's context could hold

_deadline = threading.local()


def _check_time() -> None:
    end = getattr(_deadline, "at", None)
    if end is not None and time.monotonic() > end:
        raise SecurityError(f"rendering took longer than {RENDER_SECONDS:g}s")


def _bounded_range(*args: int) -> range:
    _check_time()  # nested loops call range once per outer iteration
    return safe_range(*args)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    # `*` and `**` are intercepted: 'x' * 10**9 or 9 ** 9 ** 9 would allocate or spin first
    intercepted_binops = frozenset(["*", "**"])

    # The stock sandbox answers a forbidden attribute with an undefined value that prints
    # as "", so a hostile template would render quietly; make the attempt an error instead.
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of "
                            f"{type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise SecurityError("exponent too large")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT_CHARS:
                    raise SecurityError("repetition too large")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_time()
        return super().call(__context, __obj, *args, **kwargs)


class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' marker of what the assistant
    writes (its `return_assistant_tokens_mask`), found in TRL's training templates and some
    models' own. It renders its body unchanged; the loss mask comes from rendering the
    conversation turn by turn (mlxtoy.train.formats.Renderer), which needs no markers."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=None)
def sandbox() -> ImmutableSandboxedEnvironment:
    """jinja2's immutable sandbox with the helpers transformers gives chat templates.

    Immutable: a template from a downloaded file can read the variables it is given, but
    cannot reach Python internals or mutate anything (not even the caller's messages).
    """
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    return env


class ChatTemplate:
    """One chat template's source, compiled in the sandbox the first time it is rendered.

    where: names the template's origin (the model file) in error messages.
    """

    def __init__(self, source: str, where: str):
        self.source = source
        self.where = where
        self._compiled: Template | None = None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, bos_token: str,
               eos_token: str, extra: dict[str, Any] | None = None) -> str:
        """The prompt text; `extra` are further template variables (e.g. `tools`)."""
        try:
            if self._compiled is None:
                self._compiled = sandbox().from_string(self.source)
            # `extra` is spread here, inside the try, so a variable given twice is a UserError too
            chunks = self._compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                             bos_token=bos_token, eos_token=eos_token, **(extra or {}))
            _deadline.at = time.monotonic() + RENDER_SECONDS
            out, size = [], 0
            for chunk in chunks:
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    raise SecurityError(f"output longer than {MAX_OUTPUT_CHARS} characters")
                _check_time()
                out.append(chunk)
            return "".join(out)
        except Exception as e:  # syntax errors, sandbox violations, raise_exception(), bad data
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"{self.where}: chat template failed: {msg}") from e
        finally:
            _deadline.at = None
