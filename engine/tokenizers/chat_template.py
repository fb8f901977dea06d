"""A model's own Jinja chat template, rendered the way transformers' `apply_chat_template` does.

Source: transformers/utils/chat_template_utils.py (`render_jinja_template`, `_compile_jinja_template`)
and tokenization_utils_base.py (`apply_chat_template`), transformers 5.x. Those define how the
templates shipped in `tokenizer_config.json`, `chat_template.jinja` and GGUF files behave:

- jinja2's `ImmutableSandboxedEnvironment` (templates come from model repositories: untrusted
  code) with `trim_blocks=True`, `lstrip_blocks=True` and the `loopcontrols` extension
  (`{% break %}`, `{% continue %}`); `{% generation %}...{% endgeneration %}` blocks (assistant
  masks in training templates) render their body.
- globals `raise_exception(message)`, `strftime_now(format)`, a `dict` that only
  builds dicts, and a `namespace` that refuses underscore-prefixed attributes; the `tojson`
  filter is `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`
  (no HTML escaping, unlike jinja's own).
- variables: `messages`, `tools` (None unless given), `documents` (None), `add_generation_prompt`, and the
  tokenizer's named special tokens as strings (`bos_token`, `eos_token`, `unk_token`,
  `pad_token`, ... and model-specific `*_token` entries of tokenizer_config.json).
- messages are normalised first: keys whose value is None are dropped, values are rebuilt out
  of plain JSON types (anything else becomes a "<TypeName>" placeholder), and a message's
  reasoning under `reasoning_content` / `thinking` / `reasoning` is visible under
  `reasoning_content` (and `thinking`, if unset).

Templates are compiled once per source text (`compile_template`, cached).

Where batchgen differs: transformers' `strftime_now` reads the local clock, so a template that
prints today's date (Llama 3.x puts it in the system prompt) renders other tokens under
another time zone, on another day, on a retry or a resume. Here the caller passes the
moment (`now`): a job renders every prompt at its one date (`model.chat_template_date`), and
a call without one gets the current time in UTC.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import date, datetime, timezone
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A template that raised (`raise_exception`, a Jinja error, an error in its expressions) or
    could not be compiled. The message carries the template's own message."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}`: renders body (transformers uses the block to
    find assistant tokens for training masks; rendering is unchanged)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def chat_moment(day: "date | str | None") -> datetime:
    """The moment a template's `strftime_now` formats: midnight UTC of `day` (a date or an
    ISO "YYYY-MM-DD" string), or the current time in UTC for None. Raises ValueError for a
    string that is not an ISO date."""
    if day is None:
        return datetime.now(timezone.utc)
    if isinstance(day, str):
        day = date.fromisoformat(day)
    return datetime(day.year, day.month, day.day, tzinfo=timezone.utc)


class _DictBuilder:
    """`dict(...)` and `dict.fromkeys(...)` inside templates, without exposing the dict type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace()` refusing underscore-prefixed attribute names (a sandbox escape route)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's Namespace signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace (got {name!r})")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["dict"] = _DictBuilder()
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template for `source` (cached: each distinct text compiles once per process).

    Raises ChatTemplateError carrying jinja's message and line for a syntax error.
    """
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e.message} (line {e.lineno})") from None


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, so the sandbox never sees objects with methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and type(value).__module__ == "numpy":
        return _plain(item())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Any) -> list[dict]:
    """Messages as the template sees them (see the module docstring).

    Raises ChatTemplateError when `messages` is not a non-empty list of dicts.
    """
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty: a conversation needs at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"message {i} is a {type(m).__name__}, expected a dict with 'role' and 'content'")
        m = _plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat_template(source: str, messages: Any, special_tokens: Mapping[str, str], *,
                         add_generation_prompt: bool = True, date: "date | str | None" = None,
                         tools: list[dict] | None = None) -> str:
    """The text of `messages` rendered by the template `source`.

    messages: [{"role": ..., "content": ..., ...}, ...] (any keys the template reads).
    special_tokens: template variables such as {"bos_token": "<s>", "eos_token": "</s>"}.
    add_generation_prompt: end with the header that opens the assistant's reply.
    date: the day `strftime_now` formats (midnight UTC; `chat_moment`), None for now in UTC.
    tools: the template's `tools` variable (JSON schemas, as transformers'
    apply_chat_template(tools=...) passes them); None for none.
    Raises ChatTemplateError (a ValueError) with the template's message when it raises
    (`raise_exception`, an undefined or invalid operation, a sandbox violation) or does not
    compile, or when `messages` is not a non-empty list of dicts.
    """
    template = compile_template(source)
    chat = normalize_messages(messages)
    moment = chat_moment(date)
    variables = {k: _plain(v) for k, v in special_tokens.items()}
    try:
        return template.render(messages=chat, tools=_plain(tools), documents=None,
                               add_generation_prompt=add_generation_prompt,
                               strftime_now=lambda fmt: moment.strftime(fmt), **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e.message or e}") from None
    except Exception as e:  # noqa: BLE001 - any failure inside a template is the template's (or the data's)
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None


__all__ = ["ChatTemplateError", "chat_moment", "compile_template", "normalize_messages", "render_chat_template"]
