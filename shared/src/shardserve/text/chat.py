"""Chat templates rendered with jinja2 exactly as transformers renders them.

A checkpoint's chat template is a jinja2 program (from ``chat_template.jinja`` or
``tokenizer_config.json``). transformers compiles it in an ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}``
tag (which only marks assistant text, so it renders its body unchanged here), its own ``tojson``
filter (no HTML escaping, ``ensure_ascii=False``), and the globals ``raise_exception`` and
``strftime_now``. It renders with ``messages``, ``tools=None``, ``documents=None``,
``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``, ...) as
variables. We do the same, so the rendered prompt is the one transformers gives.

Usage::

    template = ChatTemplate(source, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

Errors: a template that does not compile, or that fails while rendering (including its own
``raise_exception("...")``), raises BadInputError (HTTP 400) with the template's message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shardserve.errors import BadInputError
from shardserve.wire.protocol import ChatMessage

__all__ = ["ChatTemplate", "Message", "TemplateVariables"]

# The wire's ChatMessage, or a plain dict with "role" and "content" (and whatever else a
# template reads, e.g. tool calls).
Message = ChatMessage | Mapping[str, Any]
TemplateVariables = Mapping[str, str | list[str]]


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers uses it to find assistant text
    for training masks; for serving it only has to parse and render its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; transformers replaces it with this.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _as_dict(message: Message) -> dict[str, Any]:
    return message.model_dump() if isinstance(message, ChatMessage) else dict(message)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


class ChatTemplate:
    """One checkpoint's chat template, compiled on first use and kept.

    Args:
        source: the jinja2 text of the template.
        special_tokens: template variables for the special tokens (``bos_token``...), as
            transformers' ``special_tokens_map`` gives them (strings, or a list of strings
            for ``additional_special_tokens``).
        servable: named in error messages.
    """

    def __init__(
        self, source: str, special_tokens: TemplateVariables, servable: str = "servable"
    ) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._servable = servable
        self._compiled: jinja2.Template | None = None

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """Return the prompt text for ``messages`` (ChatMessage or dicts with role, content)."""
        template = self._template()
        try:
            return template.render(
                messages=[_as_dict(message) for message in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as error:
            raise BadInputError(f"chat template of {self._servable}: {error.message}") from error
        except Exception as error:  # a template is a program: any failure is its answer
            raise BadInputError(
                f"chat template of {self._servable} failed: {type(error).__name__}: {error}"
            ) from error

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.source)
            except jinja2.TemplateSyntaxError as error:
                raise BadInputError(
                    f"chat template of {self._servable} does not compile: "
                    f"line {error.lineno}: {error.message}"
                ) from error
        return self._compiled
