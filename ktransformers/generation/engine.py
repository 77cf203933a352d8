"""The generation loop: chunked prefill into a static KV cache, then one token at a time.

The model is called directly (``model(input_ids=…, cache=…, position_ids=…)``), not through
``generate()``, so the per-token Python work is one forward call, one sampler call and one
small decode of the text window.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..errors import ConfigError
from .sampling import Sampler, SamplingParams
from .text import IncrementalDetokenizer, StopStrings, token_ids_of

#: end-of-turn markers of common chat templates; a tokenizer holding one as a single token
#: stops on it (the reference system stops on the ChatML end marker the same way)
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end▁of▁sentence|>", "<|endoftext|>")


@dataclass
class TokenEvent:
    """One step of a stream.  The final event has ``token_id=None`` and a ``finish_reason``."""

    token_id: int | None         # None only on the final event
    text: str                    # text newly decoded since the previous event ("" mid-character)
    finish_reason: str | None = None   # "stop" (EOS or stop string), "length", "cancelled"


class StreamOutput:
    """Turns one request's sampled token ids into TokenEvents: EOS, stop strings, the token limit
    and UTF-8-safe incremental text.  Shared by the single-request Generator and the batching
    engine, so both end a stream the same way.

    ``add(token)`` returns the event for the token (None for an EOS token, which is not emitted)
    and sets ``finish_reason`` once the stream is done; ``final(reason)`` is the last event,
    carrying whatever text was held back.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams, eos_ids: set[int],
                 max_new_tokens: int, keep_ids: frozenset[int] = frozenset()):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, keep_ids=keep_ids)
        self.stops = StopStrings(params.stop)
        self.eos = eos_ids
        self.max_new = max_new_tokens
        self.generated = 0
        self.finish_reason: str | None = "length" if max_new_tokens <= 0 else None
        self._stopped_by_string = False

    def add(self, token: int) -> "TokenEvent | None":
        self.generated += 1
        if token in self.eos:
            self.finish_reason = "stop"
            return None
        text, stopped = self.stops.feed(self.detok.add(token))
        if stopped:
            self.finish_reason = "stop"
            self._stopped_by_string = True
        elif self.generated >= self.max_new:
            self.finish_reason = "length"
        return TokenEvent(token, text)

    def final(self, reason: str | None = None) -> "TokenEvent":
        tail = ""
        if not self._stopped_by_string:
            rest, hit = self.stops.feed(self.detok.flush())
            tail = rest if hit else rest + self.stops.flush()
        return TokenEvent(None, tail, reason or self.finish_reason)


@dataclass
class GenerationStats:
    """Timings of one request.

    ``prefill_seconds`` is the time to the first token (prompt forward + first sample);
    ``decode_seconds`` the time spent producing the tokens after it, so ``decode_tps`` is
    ``(generated_tokens - 1) / decode_seconds``.  Only the generator's own work is timed, not
    the time the consumer of the stream spends between tokens.
    """

    prompt_tokens: int
    prefill_seconds: float
    generated_tokens: int
    decode_seconds: float
    cached_tokens: int = 0       # prompt tokens reused from a prefix cache, not evaluated again
    drafted_tokens: int = 0      # speculative decoding: tokens guessed, and how many the model kept
    accepted_tokens: int = 0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def line(self) -> str:
        text = (
            f"prompt eval count: {self.prompt_tokens} token(s), duration: {self.prefill_seconds:.3f}s, "
            f"{_rate(self.prefill_tps, self.prompt_tokens > 0 < self.prefill_seconds)} | "
            f"eval count: {self.generated_tokens} token(s), duration: {self.decode_seconds:.3f}s, "
            f"{_rate(self.decode_tps, self.generated_tokens > 1 and self.decode_seconds > 0)}"
        )
        if self.drafted_tokens:
            text += (f" | drafted {self.drafted_tokens}, accepted {self.accepted_tokens} "
                     f"({100 * self.acceptance:.0f} %)")
        return text


def _rate(tokens_per_second: float, measurable: bool) -> str:
    """A rate only where there was something to time (one token has no decode step)."""
    return f"rate: {tokens_per_second:.2f} tokens/s" if measurable else "rate: - (too few tokens to time)"


def _module_device(module: torch.nn.Module | None) -> torch.device | None:
    if module is None:
        return None
    for t in module.parameters():
        if t.device.type != "meta":
            return t.device
    dev = getattr(module, "generate_device", None)
    return torch.device(dev) if dev is not None else None


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends a generation: generation_config's EOS ids (all of them), the
    tokenizer's EOS, and chat end-of-turn markers the tokenizer has as single tokens."""
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if e is None:
            continue
        ids.update([e] if isinstance(e, int) else list(e))
        break
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(int(tokenizer.eos_token_id))
        if getattr(tokenizer, "chat_template", None):
            vocab_added = getattr(tokenizer, "added_tokens_encoder", {}) or {}
            for t in END_OF_TURN_TOKENS:
                if t in vocab_added:
                    ids.add(int(vocab_added[t]))
    return ids


class Generator:
    """Streams tokens from an (injected) causal LM.  One request at a time per instance.

    ``chunk_size``: prompt tokens per prefill forward.  ``max_cache_len``: an upper bound on
    prompt + new tokens (the static cache is sized prompt + max_new_tokens, capped by it).
    ``offload_cache``: keep the KV cache in host memory between layers when the model runs on
    CUDA (transformers' cache offloading; the ``long_context`` mode of local_chat).
    ``speculative``: a drafter name (generation/speculative.py: ``"ngram"``, or ``"draft"`` with a
    ``draft_model`` of the same vocabulary) to verify up to ``draft_max`` guessed tokens per step;
    the answer is the same (greedy: token for token).
    """

    def __init__(self, model, tokenizer, *, chunk_size: int = 8192, max_cache_len: int | None = None,
                 offload_cache: bool = False, speculative: str | None = None, draft_max: int = 8,
                 draft_model=None):
        from .speculative import check_drafter

        if chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1 (got {chunk_size})")
        check_drafter(speculative, draft_max, draft_model)
        if draft_model is not None:
            check_same_vocabulary(model, draft_model)
        self.speculative = speculative
        self.draft_max = int(draft_max)
        self.draft_model = draft_model
        self.model = model
        self.tokenizer = tokenizer
        self.chunk_size = int(chunk_size)
        self.max_cache_len = max_cache_len
        self.offload_cache = offload_cache
        self.last_stats: GenerationStats | None = None
        self.device = (_module_device(model.get_input_embeddings()) or _module_device(model)
                       or torch.device("cpu"))
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.keep_special_ids: frozenset[int] = frozenset()  # special tokens the streamed text keeps
        self._lock = threading.Lock()
        if speculative == "mtp":  # the model's own MTP layer (generation/mtp.py): loaded now, one error if none
            from .mtp import check_mtp_layer, load_mtp_layer, mtp_plain_notice, mtp_runner
            from .verify_forward import forward_verifies

            step = self._decode_step()
            if step is None and forward_verifies(model):  # Qwen3-Next / Qwen3.5: verified by the forward
                load_mtp_layer(model)
                mtp_runner(model, None)
            elif step is None:  # no step to verify guesses: the layer is checked, not loaded; plain decoding
                check_mtp_layer(model)
                off = os.environ.get("KT_LEAN_DECODE", "1") == "0"
                mtp_plain_notice(model, "KT_LEAN_DECODE=0" if off else None)
            else:
                load_mtp_layer(model)
                mtp_runner(model, step)

    def keep_special_tokens(self, texts) -> None:
        """Keep these special tokens in the streamed text (tool-call markers, harmony channels that
        the server parses); other special tokens are left out as before."""
        self.keep_special_ids = token_ids_of(self.tokenizer, texts)

    # ---------------------------------------------------------------------------------- model
    def new_cache(self, max_cache_len: int):
        from transformers import DynamicCache, StaticCache
        from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING

        # offloading moves layers between a CUDA device and host memory; on the CPU the cache already
        # lives in host memory
        offload = self.offload_cache and self.device.type == "cuda"
        cfg = self.model.config
        types = getattr(cfg.get_text_config(decoder=True), "layer_types", None) or ()
        if any(t not in STATIC_LAYER_TYPE_MAPPING for t in types):
            # layers whose cache only the model's own dynamic layer classes hold (DeepSeek-V4's
            # compressor state and compressed entries)
            return DynamicCache(config=cfg, offloading=offload)
        return StaticCache(config=cfg, max_cache_len=max_cache_len, offloading=offload)

    def _forward(self, ids: torch.Tensor, start: int, cache, vision=None) -> torch.Tensor:
        n = ids.shape[1]
        if vision is not None:  # after a prompt with images: the model's forward at M-RoPE positions
            out = self.model(input_ids=ids, cache=cache, position_ids=vision.positions(start, n, self.device),
                             use_cache=True, logits_to_keep=1)
            return out.logits[:, -1].float()
        if n == 1 and ids.shape[0] == 1:
            step = self._decode_step()
            if step is not None and step.accepts(cache):
                logits = step.step(int(ids[0, 0]), start, cache)
                if logits is not None:
                    return logits
        pos = torch.arange(start, start + n, device=self.device).unsqueeze(0)
        out = self.model(input_ids=ids, cache=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _decode_step(self):
        """The lean single-token step (generation/decode_step.py) unless ``KT_LEAN_DECODE=0``."""
        step = self.__dict__.get("_step", False)
        if step is False:
            from .decode_step import decode_step_for

            step = decode_step_for(self.model) if os.environ.get("KT_LEAN_DECODE", "1") != "0" else None
            self._step = step
        return step

    def prefill(self, input_ids: list[int], cache, cancel: threading.Event | None = None,
                vision=None, hidden: list | None = None) -> torch.Tensor | None:
        """Run the prompt through the model in chunks; logits [1, V] (fp32) of its last position.

        Every chunk is read by the model's prompt forward, a one-token chunk too (never the decode
        step, whose attention sums in another order): the cache and logits are the same bits
        whatever the chunking.  Returns None when ``cancel`` was set between chunks.  A prompt with
        images (``vision``: multimodal/prompt.py) is read in one forward that takes them.  ``hidden``:
        a list that receives the final hidden states (after the final norm) of the prompt's
        positions, ``[T, hidden]`` per chunk (the MTP drafter's input).
        """
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        logits = None
        if vision is not None:
            with torch.inference_mode():
                forward = self.model.__dict__.get("_kt_lean_forward") or self.model
                out = forward(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1,
                              **vision.prefill_kwargs(self.model, ids))
            return out.logits[:, -1].float()
        hook = None
        if hidden is not None:
            hook = self.model.get_decoder().norm.register_forward_hook(
                lambda mod, args, out: hidden.append(out[0].detach().float().cpu().clone()))
        from ..operators.mla import prompt_rows

        try:
            with torch.inference_mode(), prompt_rows():  # a one-token chunk too is read as prompt rows
                for start in range(0, ids.shape[1], self.chunk_size):
                    if cancel is not None and cancel.is_set() and start > 0:
                        return None
                    chunk = ids[:, start:start + self.chunk_size]
                    pos = torch.arange(start, start + chunk.shape[1], device=self.device).unsqueeze(0)
                    # the model's own forward, not generate()'s lean-step wrapper (hf_generate.py)
                    forward = self.model.__dict__.get("_kt_lean_forward") or self.model
                    out = forward(input_ids=chunk, cache=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
                    logits = out.logits[:, -1].float()
        finally:
            if hook is not None:
                hook.remove()
        return logits

    # ----------------------------------------------------------------------------- requests
    def stream(self, input_ids: list[int], params: SamplingParams,
               cancel: threading.Event | None = None) -> Iterator[TokenEvent]:
        """Generate for ``input_ids``; yields one event per token and a final event."""
        params.validate()
        vision = getattr(input_ids, "vision", None)  # a prompt with images (multimodal/prompt.py: ImagePrompt)
        input_ids = [int(i) for i in input_ids]
        n = len(input_ids)
        if n == 0:
            raise ConfigError("empty prompt: nothing to generate from")
        max_new = params.max_new_tokens
        if self.max_cache_len is not None:
            if n >= self.max_cache_len:
                raise ConfigError(f"prompt of {n} tokens does not fit the cache of {self.max_cache_len} tokens")
            max_new = min(max_new, self.max_cache_len - n)
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this Generator is already streaming a request; use one Generator per stream")
        try:
            yield from self._stream(input_ids, params, max_new, cancel, vision)
        finally:
            self._lock.release()

    def _stream(self, input_ids, params, max_new, cancel, vision=None):
        n = len(input_ids)
        stats = GenerationStats(prompt_tokens=n, prefill_seconds=0.0, generated_tokens=0, decode_seconds=0.0)
        self.last_stats = stats
        if max_new == 0:
            yield TokenEvent(None, "", "length")
            return
        out = StreamOutput(self.tokenizer, input_ids, params, self.eos_ids, max_new,
                           keep_ids=self.keep_special_ids)

        t0 = time.perf_counter()
        cap = n + max_new
        cache = self.new_cache(cap)
        hidden = [] if self.speculative == "mtp" and vision is None and self._verifies_rows() else None
        logits = self.prefill(input_ids, cache, cancel, vision, hidden=hidden)
        stats.prefill_seconds = time.perf_counter() - t0  # updated below to include the first sample
        sampler = Sampler(params, logits.device if logits is not None else self.device)
        history = None
        if sampler.needs_ids:
            history = torch.zeros((1, cap), dtype=torch.long, device=sampler_device(logits, self.device))
            history[0, :n] = torch.tensor(input_ids, dtype=torch.long)
        spec = self._speculation(input_ids, cap, hidden) if vision is None else None
        try:
            yield from self._decode(input_ids, max_new, cancel, vision, out, stats, cache, logits, sampler, history,
                                    spec, t0)
        finally:
            if spec is not None and hasattr(spec[0], "close"):
                spec[0].close()

    def _decode(self, input_ids, max_new, cancel, vision, out, stats, cache, logits, sampler, history, spec, t0):
        """The decode loop of ``_stream`` after the prefill (``spec``: (drafter, policy) or None)."""
        n, cap = len(input_ids), len(input_ids) + max_new
        pos = n          # where the newest decided token goes in the cache
        finish = None
        first = True
        decided: list[int] = []  # tokens to emit: all but the last are in the cache (accepted guesses)
        while True:
            if not decided:
                if logits is None or (cancel is not None and cancel.is_set()):
                    finish = "cancelled"
                    break
                with torch.inference_mode():
                    decided = [sampler(logits, history[:, :pos] if history is not None else None)]
            for j, token in enumerate(decided):
                event = out.add(token)
                if spec is not None:
                    spec[0].append(token)
                stats.generated_tokens = out.generated
                now = time.perf_counter()
                if first:
                    stats.prefill_seconds = now - t0
                    first = False
                else:
                    stats.decode_seconds += now - t0
                t0 = now
                if event is not None:
                    yield event
                    t0 = time.perf_counter()  # the consumer's time between tokens is not ours
                if out.finish_reason is not None:
                    finish = out.finish_reason
                    break
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
                if j + 1 < len(decided):
                    pos += 1  # an accepted guess: already in the cache
            if finish is not None:
                break
            token, decided = decided[-1], []
            t0 = time.perf_counter()
            if history is not None:
                history[0, pos] = token
            room = min(cap - 1 - pos, max_new - out.generated - 1)
            guesses = spec[0].draft(min(spec[1].next_k(), room)) if spec is not None and room > 0 else []
            with torch.inference_mode():
                got = (self._verify(token, guesses, pos, cache, sampler, history, stats, spec[1], spec[0])
                       if guesses else None)
                if got is not None:
                    decided = got  # sampled already; the next logits are not needed
                else:
                    if guesses:  # the step does not take this cache: plain decoding from here
                        if hasattr(spec[0], "close"):
                            spec[0].close()
                        spec = None
                    logits = self._forward(torch.tensor([[token]], dtype=torch.long, device=self.device), pos, cache,
                                           vision)
                    if spec is not None and hasattr(spec[0], "took"):
                        spec[0].took(pos)
            pos += 1
        yield out.final(finish)

    def _speculation(self, input_ids, capacity: int, hidden: list | None = None):
        """(drafter, policy) for a request when the Generator speculates and its decode step can
        verify rows (else None: plain decoding, the same tokens).  ``hidden``: the prompt's final
        hidden states (the MTP drafter's)."""
        if self.speculative is None:
            return None
        step = self._decode_step()
        if not self._verifies_rows() or (self.speculative == "mtp" and not hidden):
            return None  # no way to verify rows: plain decoding
        from .speculative import Policy, make_drafter

        draft = Generator(self.draft_model, None) if self.draft_model is not None else None
        prompt_hidden = torch.cat(hidden) if hidden else None
        drafter = make_drafter(self.speculative, draft, capacity, self.model, step, prompt_hidden)
        drafter.extend(input_ids)
        return drafter, Policy(self.draft_max)

    def _verifies_rows(self) -> bool:
        """Whether guesses can be verified: by the decode step's rows, or by the model's own forward
        (Qwen3-Next / Qwen3.5, generation/verify_forward.py)."""
        if self._decode_step() is not None:
            return True
        from .verify_forward import forward_verifies

        return forward_verifies(self.model)

    def _verify(self, token, guesses, pos, cache, sampler, history, stats, policy, drafter=None) -> list[int] | None:
        """One speculative step: ``token`` at ``pos`` and the ``guesses`` after it as rows of one
        step; the accepted guesses and the model's token after them (the cache keeps exactly the
        rows of ``token`` and the accepted guesses), or None when the step cannot take the cache."""
        step = self._decode_step()
        rows = [token] + list(guesses)
        if step is None:  # a model the decode step does not serve: its own forward (verify_forward.py)
            from .verify_forward import forward_rows

            got = forward_rows(self.model, rows, pos, cache, self.device)
            if got is not None and hasattr(drafter, "took"):
                drafter.took(pos)
        else:
            got = step.step_rows(rows, pos, cache) if step.accepts(cache) else None
        if got is None:
            return None
        logits, undo = got
        decided = []
        for i in range(len(rows)):
            if history is not None:
                history[0, pos + i] = rows[i]
            guess = rows[i + 1] if i + 1 < len(rows) else None
            t = sampler.verify(logits[i:i + 1], history[:, :pos + i + 1] if history is not None else None, guess)
            decided.append(t)
            if t != guess:
                break
        accepted = len(decided) - 1
        undo(accepted + 1)
        stats.drafted_tokens += len(guesses)
        stats.accepted_tokens += accepted
        policy.update(len(guesses), accepted)
        return decided

    def generate(self, input_ids: list[int], params: SamplingParams,
                 cancel: threading.Event | None = None) -> tuple[str, list[int], str]:
        """Whole answer at once: (text, generated token ids without EOS, finish_reason)."""
        parts: list[str] = []
        ids: list[int] = []
        finish = "stop"
        for ev in self.stream(input_ids, params, cancel):
            parts.append(ev.text)
            if ev.token_id is not None:
                ids.append(ev.token_id)
            if ev.finish_reason is not None:
                finish = ev.finish_reason
        return "".join(parts), ids, finish

    # ------------------------------------------------------------------------------ prompts
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools=None, **template_kwargs) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template.

        ``template_kwargs`` are variables the template may read (``enable_thinking`` ...).
        A tokenizer without a template (a base model) gets plain concatenation: each message's
        text in order, an assistant message continuing the text before it directly, and a
        newline before a user/system message that does not follow whitespace.
        """
        if self.has_chat_template():
            kw = {"tools": tools} if tools else {}
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw, **template_kwargs
            )
            return self.encode(text, add_special_tokens=False)
        text = ""
        for m in messages:
            part = message_text(m.get("content"))
            if text and m.get("role") != "assistant" and not text[-1].isspace():
                text += "\n"
            text += part
        return self.encode(text, add_special_tokens=True)


def check_same_vocabulary(model, draft_model) -> None:
    """A draft model guesses token ids: its vocabulary must be the target's (same size)."""
    sizes = [int(getattr(m.config.get_text_config(), "vocab_size", 0) or 0) for m in (model, draft_model)]
    if sizes[0] != sizes[1]:
        raise ConfigError(f"draft model: vocabulary of {sizes[1]} tokens, the model's has {sizes[0]}; a draft model "
                          "must share the model's tokenizer")


def sampler_device(logits: torch.Tensor | None, default: torch.device) -> torch.device:
    return logits.device if logits is not None else default


def message_text(content) -> str:
    """The text of a chat message's content (a string, or OpenAI-style list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for p in content:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, dict) and p.get("type") in ("text", None):
            out.append(str(p.get("text", "")))
    return "".join(out)
