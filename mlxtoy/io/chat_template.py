"""Chat templates: jinja2 templates from model files, rendered in a strict sandbox.

- `ChatTemplate`: one template, compiled on first use; `render` turns messages into the prompt
  text, and any failure (syntax, sandbox violation, `raise_exception`) into a UserError;
- `CHATML_TEMPLATE`: what a tokenizer without a template of its own renders with;
- the sandbox gives templates the helpers transformers does (`raise_exception`,
  `strftime_now`, a `tojson` that keeps non-ASCII text) and nothing else.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from jinja2 import Template
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxtoy.errors import UserError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    # The stock sandbox answers a forbidden attribute with an undefined value that prints
    # as "", so a hostile template would render quietly; make the attempt an error instead.
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of "
                            f"{type(obj).__name__!r} object is unsafe")


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
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
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
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **(extra or {}))
        except Exception as e:  # syntax errors, sandbox violations, raise_exception(), bad data
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"{self.where}: chat template failed: {msg}") from e
