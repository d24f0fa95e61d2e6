"""Chat messages to one prompt string: the tokenizer's own jinja chat template.

One definition for the router (which renders and tokenizes) and the replicas: every
tokenizer of ``unicache.contract.tokenizer`` carries its ``chat_template`` (a ``ChatTemplate``, or
None when the model ships none), and ``render_chat`` is the only renderer.

* A Hugging Face tokenizer directory: the template transformers would use, loaded the way
  transformers loads it (``chat_template.jinja`` over ``tokenizer_config.json``'s
  ``chat_template``, a string or a list of named templates, plus
  ``additional_chat_templates/*.jinja``; the one named ``default`` when there are several),
  rendered the way ``apply_chat_template`` renders it: a sandboxed jinja2 environment with
  ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}``
  tag, transformers' ``tojson`` filter (no HTML escaping, ``indent``/``separators``/
  ``sort_keys``), the ``raise_exception`` and ``strftime_now`` globals, and the variables
  ``messages``, ``tools`` (None), ``documents`` (None), ``add_generation_prompt`` and the
  tokenizer's special tokens (``bos_token``, ``eos_token``, ...).
* The byte-level default tokenizer: ``BYTE_CHAT_TEMPLATE``, per message
  ``<|{role}|>\\n{content}\\n``, then ``<|assistant|>\\n``.

Both grow by appending: turn k+1's prompt starts with turn k's prompt and output (for
templates that render earlier turns unchanged, as chat templates do), which is what
prefix caching and session routing exploit.

Message content may be a string or a list of OpenAI text parts (joined, as vLLM does for
string-content templates); other message keys reach the template unchanged.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatFormatError(ValueError):
    """The messages cannot be rendered (HTTP 400 / gRPC INVALID_ARGUMENT); says why."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers marks assistant spans with it)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


class ChatTemplate:
    """A compiled chat template plus the special-token strings it sees.

    Args:
        source: jinja2 source (as in tokenizer_config.json's ``chat_template``).
        special_tokens: ``bos_token``, ``eos_token``, ... as strings (template variables).
        roles: the roles accepted (None: any non-empty string; the template may refuse).

    Raises:
        ValueError: the source does not compile (names the line).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, roles: tuple[str, ...] | None = None):
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat_template does not compile: {exc.message} (line {exc.lineno})") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.roles = roles

    def render(self, messages: Any, add_generation_prompt: bool = True) -> str:
        """The prompt for ``messages``; raises ChatFormatError (bad messages or a template's refusal)."""
        msgs = _normalize(messages, self.roles)
        try:
            return self._template.render(
                **self.special_tokens, messages=msgs, tools=None, documents=None, add_generation_prompt=add_generation_prompt
            )
        except jinja2.TemplateError as exc:
            raise ChatFormatError(f"chat template: {exc.message or type(exc).__name__}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatFormatError(f"chat template failed on these messages: {exc}") from None

    @classmethod
    def from_directory(cls, directory: str, special_tokens: Mapping[str, str] | None = None) -> "ChatTemplate | None":
        """The template transformers would load from a tokenizer directory, or None if it has none.

        Raises:
            ValueError: a template that does not compile, or several without a ``default``.
        """
        templates = _templates_in(directory)
        if not templates:
            return None
        if len(templates) > 1 and "default" not in templates:
            raise ValueError(f"{directory}: several chat templates ({', '.join(sorted(templates))}) and none named 'default'")
        return cls(templates.get("default") or next(iter(templates.values())), special_tokens)


def _templates_in(directory: str) -> dict[str, str]:
    templates: dict[str, str] = {}
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            raw = json.load(f).get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            templates.update({t["name"]: t["template"] for t in raw})
    # NOTE: as in transformers, standalone .jinja files replace the config's templates.
    files: dict[str, str] = {}
    single = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(single):
        files["default"] = _read(single)
    extra = os.path.join(directory, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                files[name.removesuffix(".jinja")] = _read(os.path.join(extra, name))
    return files or templates


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _content_text(content: Any, i: int) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError(f"messages[{i}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return None  # as transformers passes it (e.g. an assistant turn with only tool_calls)
    raise ChatFormatError(f"messages[{i}].content must be a string or a list of text parts")


def _normalize(messages: Any, roles: tuple[str, ...] | None) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatFormatError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if roles is not None and role not in roles:
            raise ChatFormatError(f"messages[{i}].role must be one of {', '.join(roles)}")
        if not isinstance(role, str) or not role:
            raise ChatFormatError(f"messages[{i}].role must be a non-empty string")
        out.append({**msg, "content": _content_text(msg.get("content"), i)})
    return out


BYTE_CHAT_TEMPLATE = ChatTemplate(
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    roles=ROLES,
)


def render_chat(messages: Any, template: ChatTemplate | None) -> str:
    """``template.render(messages)``; ChatFormatError when the model has no chat template."""
    if template is None:
        raise ChatFormatError("this model's tokenizer has no chat_template; send a prompt to /v1/completions instead")
    return template.render(messages)
