"""Prompt templates and tokenization for training: loss on the assistant's tokens only.

A conversation is rendered as alternating *prompt* and *response* pieces; prompt tokens get the
label -100 (ignored by the loss), response tokens (the answer and the template's end-of-turn
token) keep their ids.  The pieces come either from a named template (LLaMA-Factory's names,
:data:`TEMPLATES`) or from the tokenizer's own chat template, rendered turn by turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Template:
    """Plain-text formats; ``{content}`` is the message text, ``{eos}`` the tokenizer's EOS token."""

    user: str
    assistant: str
    system: str = "{content}"
    default_system: str = ""
    prefix: str = ""  # once, before everything (a BOS text)
    stop: tuple[str, ...] = ("{eos}",)  # tokens that must exist as single tokens in the vocabulary


_CHATML = dict(system="<|im_start|>system\n{content}<|im_end|>\n",
               user="<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
               assistant="{content}<|im_end|>\n", stop=("<|im_end|>",))

TEMPLATES: dict[str, Template] = {
    "default": Template(user="Human: {content}\nAssistant:", assistant="{content}{eos}\n",
                        system="System: {content}\n"),
    "alpaca": Template(user="### Instruction:\n{content}\n\n### Response:\n", assistant="{content}{eos}\n\n",
                       system="{content}\n\n",
                       default_system="Below is an instruction that describes a task. "
                                      "Write a response that appropriately completes the request."),
    "chatml": Template(**_CHATML),
    "qwen": Template(**_CHATML, default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "qwen3": Template(**_CHATML),
    "llama3": Template(prefix="<|begin_of_text|>",
                       system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
                       user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
                            "<|start_header_id|>assistant<|end_header_id|>\n\n",
                       assistant="{content}<|eot_id|>", stop=("<|eot_id|>",)),
    "deepseek3": Template(prefix="<｜begin▁of▁sentence｜>", user="<｜User｜>{content}<｜Assistant｜>",
                          assistant="{content}<｜end▁of▁sentence｜>", stop=("<｜end▁of▁sentence｜>",)),
}


def _pieces_named(tpl: Template, messages: list[dict], eos: str) -> list[tuple[str, bool]]:
    """(text, is_response) pieces of a conversation under a named template."""
    out: list[tuple[str, bool]] = []
    system = tpl.default_system
    msgs = messages
    if msgs and msgs[0]["role"] == "system":
        system, msgs = msgs[0]["content"], msgs[1:]
    head = tpl.prefix + (tpl.system.format(content=system, eos=eos) if system else "")
    for m in msgs:
        if m["role"] == "user":
            out.append((head + tpl.user.format(content=m["content"], eos=eos), False))
            head = ""
        else:
            out.append((tpl.assistant.format(content=m["content"], eos=eos), True))
    return out


def _pieces_chat_template(tokenizer, messages: list[dict], origin: str) -> list[tuple[str, bool]]:
    """Pieces from the tokenizer's chat template: each assistant turn is what rendering it adds
    to the conversation before it (with the generation prompt)."""
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    out: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(messages[:i], True)
        full = render(messages[:i + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise ConfigError(f"{origin}: the chat template does not render a conversation as a growing prefix; "
                              "set template: (e.g. chatml) in the config")
        out.append((prompt[len(done):], False))
        out.append((full[len(prompt):], True))
        done = full
    return out


def check_template(name: str | None, tokenizer) -> None:
    """The template exists and its stop tokens are single tokens of this tokenizer."""
    if name is None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("template: the tokenizer has no chat template; name one of "
                              f"{', '.join(TEMPLATES)}, or give chat_template: NAME|FILE.jinja")
        return
    if name not in TEMPLATES:
        import difflib

        near = difflib.get_close_matches(name, TEMPLATES, n=1, cutoff=0.5)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise ConfigError(f"template: unknown template '{name}'{hint} (known: {', '.join(TEMPLATES)})")
    eos = tokenizer.eos_token
    for stop in TEMPLATES[name].stop:
        text = stop.format(eos=eos) if "{eos}" in stop else stop
        if not text or len(tokenizer.encode(text, add_special_tokens=False)) != 1:
            raise ConfigError(f"template: '{name}' ends turns with {text!r}, which is not a single token of "
                              "this tokenizer; pick the model's own template")


def encode(messages: list[dict], tokenizer, template: str | None, cutoff_len: int,
           origin: str = "chat template") -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation, cut to ``cutoff_len`` tokens."""
    if template is None:
        pieces = _pieces_chat_template(tokenizer, messages, origin)
    else:
        pieces = _pieces_named(TEMPLATES[template], messages, tokenizer.eos_token or "")
    ids: list[int] = []
    labels: list[int] = []
    for text, is_response in pieces:
        toks = tokenizer.encode(text, add_special_tokens=False)
        ids += toks
        labels += toks if is_response else [IGNORE_INDEX] * len(toks)
        if len(ids) >= cutoff_len:
            break
    return ids[:cutoff_len], labels[:cutoff_len]
