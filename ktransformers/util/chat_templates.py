"""``--chat_template NAME|FILE``: the chat template a user gives instead of the model's own.

A FILE is Jinja text, as transformers' ``apply_chat_template(chat_template=...)`` and llama.cpp's
``--chat-template-file`` take it.  A NAME is one of the GGUF file's named templates
(``tokenizer.chat_template.<name>``, e.g. ``tool_use``), of a tokenizer folder's named templates,
or of the few built in here (:data:`BUILTIN_TEMPLATES`), for base models that carry none.
Without the option the model's own template is used.

A template is checked when it is chosen: it must compile and render a one-message conversation,
else one :class:`~ktransformers.errors.ConfigError` line names the file (or name) and the
template line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError

#: what a model without a template is told (local_chat, the server, sft)
ADD_TEMPLATE_HINT = "--chat_template NAME|FILE.jinja adds one (built in: chatml, gemma, llama3)"

_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
           "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
           "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Gemma has no system turn: a system message opens the first user turn, as Gemma's own template does
_GEMMA = ("{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
          "{% set first = messages[0]['content'] | trim ~ '\n\n' %}{% set turns = messages[1:] %}"
          "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
          "{% for m in turns %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
          "{{ (first if loop.first else '') ~ (m['content'] | trim) }}<end_of_turn>\n{% endfor %}"
          "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

#: templates known by name to every front end (the model's own named templates come first)
BUILTIN_TEMPLATES: dict[str, str] = {"chatml": _CHATML, "gemma": _GEMMA, "llama3": _LLAMA3}

_GGUF_PREFIX = "tokenizer.chat_template."


def named_templates(tokenizer=None, metadata: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The model's own named templates: a GGUF's ``tokenizer.chat_template.<name>`` keys and a
    tokenizer folder's named templates (transformers keeps those as a dict)."""
    out: dict[str, str] = {}
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        out.update({str(k): v for k, v in own.items() if isinstance(v, str)})
    for key, value in (metadata or {}).items():
        if isinstance(key, str) and key.startswith(_GGUF_PREFIX) and isinstance(value, str):
            out[key[len(_GGUF_PREFIX):]] = value
    return out


def resolve_chat_template(spec: str, tokenizer=None, metadata: Mapping[str, Any] | None = None,
                          option: str = "--chat_template") -> tuple[str, str]:
    """(template text, where it came from) for ``spec``, a Jinja file or a template name."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{option}: give a Jinja file or a template name ({', '.join(BUILTIN_TEMPLATES)})")
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read the chat template ({getattr(e, 'strerror', None) or e})") \
                from None
        if not text.strip():
            raise ConfigError(f"{path}: the chat template file is empty")
        return text, str(path)
    if path.is_dir():
        raise ConfigError(f"{option} {spec}: a folder, not a Jinja file")
    own = named_templates(tokenizer, metadata)
    if spec in own:
        return own[spec], f"the model's template '{spec}'"
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec], f"the built-in template '{spec}'"
    if "/" in spec or path.suffix:
        raise ConfigError(f"{option} {spec}: no such file")
    names = list(own) + [n for n in BUILTIN_TEMPLATES if n not in own]
    raise ConfigError(f"{option} {spec}: no such file, and not a template name (names: {', '.join(names)})")


def _template_line(exc: BaseException) -> int | None:
    """The template line a Jinja error points at: its own ``lineno``, else the deepest frame of the
    compiled template in its traceback."""
    line = getattr(exc, "lineno", None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def check_chat_template(text: str, where: str, tokenizer=None) -> None:
    """ConfigError ``where:line: ...`` unless ``text`` compiles and renders a one-message conversation
    as transformers renders chat templates."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        compiled = _compile_jinja_template(text)
    except TemplateError as e:
        raise _error(where, "does not compile", e) from None
    specials = {k: str(getattr(tokenizer, k, None) or "") for k in ("bos_token", "eos_token")}
    try:
        compiled.render(messages=[{"role": "user", "content": "Hello"}], add_generation_prompt=True, **specials)
    except Exception as e:  # noqa: BLE001 - any error the template raises, raise_exception() included
        raise _error(where, "does not render a one-message conversation", e) from None


def _error(where: str, what: str, e: BaseException) -> ConfigError:
    line = _template_line(e)
    msg = (str(getattr(e, "message", None) or e).splitlines() or [type(e).__name__])[0]
    return ConfigError(f"{where}{f':{line}' if line else ''}: the chat template {what}: {type(e).__name__}: {msg}")


def precheck_chat_template(spec: str | None, option: str = "--chat_template") -> None:
    """Check ``spec`` before a model is loaded where that is possible: a file (it must exist,
    compile and render) or a path that is missing; a bare name may be one of the model's own,
    known once its weights are open, so it waits for :func:`use_chat_template`."""
    if spec is None:
        return
    path = Path(spec).expanduser()
    if path.is_file() or "/" in spec or path.suffix or not spec.strip():
        text, where = resolve_chat_template(spec, option=option)
        check_chat_template(text, where)


def use_chat_template(tokenizer, spec: str | None, metadata: Mapping[str, Any] | None = None,
                      option: str = "--chat_template") -> None:
    """Give ``tokenizer`` the template ``spec`` names (checked), recording where it came from in
    ``tokenizer.kt_template_origin``; ``spec`` None keeps the model's own."""
    if spec is None:
        return
    text, where = resolve_chat_template(spec, tokenizer, metadata, option)
    check_chat_template(text, where, tokenizer)
    tokenizer.chat_template = text
    tokenizer.kt_template_origin = where
