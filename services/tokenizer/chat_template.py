"""A model's chat template rendered with jinja2 directly, as transformers' `apply_chat_template`
renders it (same environment, same helpers, same arguments), without importing transformers.

What the template sees, as in transformers 5 (`utils/chat_template_utils.py`):
- an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loop-controls
  extension and a `{% generation %}` block (training templates mark assistant spans with it;
  it renders its body unchanged);
- `tojson` without HTML escaping (json.dumps, ensure_ascii=False), `raise_exception`,
  `strftime_now`, a `dict` constructor and a `namespace` that refuses underscore names;
- `messages`, `tools` (None or the OpenAI tool definitions), `documents` (None),
  `add_generation_prompt`, the named special tokens (bos_token, ...), then the request's
  chat_template_kwargs, which win over the special tokens.

Which template: `--chat-template FILE` if given, else chat_template.jinja beside the tokenizer
(plus any additional_chat_templates/NAME.jinja), else tokenizer_config.json's `chat_template`
(a string, or a list of {name, template}). With several named templates, "tool_use" is used
when the request has tools and the model has one, else "default", as transformers picks.

How OpenAI messages become template messages (vLLM's rules, `chat_utils.py`): content is a
string (text parts joined with newlines, null as ""), `name` is kept when given, assistant
`tool_calls` keep OpenAI's shape but with `function.arguments` parsed into a dict (the form
tool-use templates expect; arguments that are not a JSON object become {}), an empty
`tool_calls` list is dropped, tool messages carry `tool_call_id`, and an assistant turn's
`reasoning_content` is passed when the client sent it back (Qwen3's template reads it). A template that never
reads `tools` would drop them: tool_prompt.py writes them, the calls and the results as text. A "developer"
message (OpenAI's newer name for the system turn) is a system one where the template never names that role.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rill.services.tokenizer.tool_prompt import SYSTEM_TOOLS
from rill.shared.request_params import ChatMessage
from rill.shared.tokenizer_files import read_json

log = logging.getLogger("rill.tokenizer.chat_template")

# Names the renderer sets itself: a request's chat_template_kwargs may not replace them (vLLM
# refuses chat_template and tokenize likewise).
RESERVED_KWARGS = frozenset({"messages", "chat_template", "tokenize"})


# transformers' marker for where the final message's text ends (continue_final_message).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateError(ValueError):
    """The template (or the request's arguments to it) could not produce a prompt."""


class ContinueError(ValueError):
    """continue_final_message asked of a template that does not write the final message as given
    (the request's field is at fault, not the messages: no other rendering is tried)."""


# ---------------------------------------------------------------------------------------------
# The jinja environment transformers uses


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, with no attribute access to dict's internals."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names (no way into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick: `self` may be a key)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body (transformers tracks the span
    for assistant masks in training; serving only needs the text)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# ---------------------------------------------------------------------------------------------
# Templates of a model


class ChatTemplate:
    """One compiled template."""

    def __init__(self, source: str, env: ImmutableSandboxedEnvironment) -> None:
        self.source = source
        self._env = env
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"the chat template does not parse: {exc}") from exc

    @cached_property
    def variables(self) -> frozenset[str]:
        """The names the template reads from its context (chat_template_kwargs may set these)."""
        return frozenset(jinja2.meta.find_undeclared_variables(self._env.parse(self.source)))

    @property
    def reads_tools(self) -> bool:
        """Whether it renders a request's tools at all (else tool_prompt.py writes them as text)."""
        return "tools" in self.variables

    @cached_property
    def takes_system_tools(self) -> bool:
        """Whether it renders tools only as a system message's own `tools` (Phi-4-mini's)."""
        return not self.reads_tools and SYSTEM_TOOLS.search(self.source) is not None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, special_tokens: Mapping[str, str] | None = None,
               kwargs: Mapping[str, Any] | None = None, continue_final_message: bool = False) -> str:
        """The prompt text; with `continue_final_message`, cut where the final message's text ends
        (no end of turn after it), so the model goes on writing that message."""
        if "developer" not in self.source:  # OpenAI's newer name for the system turn, unknown to most templates
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        final = ""
        if continue_final_message:
            final = messages[-1]["content"]
            if "content" not in self.source:
                raise ContinueError("continue_final_message: the chat template never writes a message's content")
            messages = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
        # The request's kwargs win, over tools and add_generation_prompt too (as in vLLM).
        context = {**(special_tokens or {}), "messages": messages, "tools": tools, "documents": None,
                   "add_generation_prompt": add_generation_prompt, **(kwargs or {})}
        try:
            text = self._template.render(context)
        except Exception as exc:  # raise_exception(...), or messages the template cannot handle (TypeError...)
            raise TemplateError(str(exc) or type(exc).__name__) from exc
        return _cut_at_tag(text, final) if continue_final_message else text


def _cut_at_tag(text: str, final: str) -> str:
    """transformers' cut: before the tag, less the spacing a template that trims the message
    took from the tag's end."""
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ContinueError("continue_final_message: the chat template does not write the final message as "
                            "given (it drops or rewrites it), so there is no place to continue it")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


@lru_cache(maxsize=32)
def request_template(source: str) -> ChatTemplate:
    """A request's own template (vLLM's chat_template field), compiled once per text."""
    return ChatTemplate(source, environment())


class ChatTemplates:
    """A model's templates by name ("default", "tool_use", ...) and the rule that picks one."""

    def __init__(self, sources: Mapping[str, str]) -> None:
        env = environment()
        self.templates = {name: ChatTemplate(src, env) for name, src in sources.items()}

    def __bool__(self) -> bool:
        return bool(self.templates)

    def pick(self, has_tools: bool) -> ChatTemplate:
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        if has_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise TemplateError(f"the model has several chat templates and none is the default: {sorted(self.templates)}")


def load_templates(model_dir: str | Path, override: str | Path | None = None,
                   tokenizer_config: Mapping[str, Any] | None = None) -> ChatTemplates:
    """The templates of `model_dir`, or only the one in the file `override` (--chat-template)."""
    if override is not None:
        return ChatTemplates({"default": Path(override).read_text(encoding="utf-8")})
    folder = Path(model_dir)
    sources: dict[str, str] = {}
    config = read_json(folder / "tokenizer_config.json") if tokenizer_config is None else tokenizer_config
    inline = config.get("chat_template")
    if isinstance(inline, str):
        sources["default"] = inline
    elif isinstance(inline, list):
        sources.update({t["name"]: t["template"] for t in inline if isinstance(t, dict)})
    # Files beside the tokenizer win over tokenizer_config.json, as in transformers.
    if (folder / "chat_template.jinja").is_file():
        sources["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            sources[f.stem] = f.read_text(encoding="utf-8")
    return ChatTemplates(sources)


# ---------------------------------------------------------------------------------------------
# OpenAI messages as templates expect them


def _arguments(name: str, raw: str) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        # The call lives in the history: refusing it would fail every later turn (vLLM keeps going too).
        log.warning("tool call %r has arguments that are not JSON (%d chars); passing {}", name, len(raw))
        return {}
    return parsed if isinstance(parsed, dict) else {}


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.name, "arguments": _arguments(c.name, c.arguments)}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def template_kwargs(template: ChatTemplate, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The request's chat_template_kwargs the template reads; others are dropped as in vLLM."""
    reserved = RESERVED_KWARGS & kwargs.keys()
    if reserved:
        raise TemplateError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    return {k: v for k, v in kwargs.items() if k in template.variables}
