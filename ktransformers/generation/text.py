"""Text side of generation: incremental detokenization and stop strings."""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
#: prompt tokens kept in the decode window, so the first generated token keeps its leading space
PROMPT_CONTEXT_TOKENS = 5


def special_ids(tokenizer) -> frozenset[int]:
    """Ids that ``decode(skip_special_tokens=True)`` leaves out: added tokens marked special."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {i for i, t in decoder.items() if getattr(t, "special", False)}
    return frozenset(ids | set(getattr(tokenizer, "all_special_ids", []) or []))


def token_ids_of(tokenizer, texts) -> frozenset[int]:
    """Ids of the added tokens whose text is one of ``texts`` (markers spelled as one token)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    want = set(texts)
    return frozenset(i for i, t in decoder.items() if str(getattr(t, "content", t)) in want)


class IncrementalDetokenizer:
    """Decode a growing token list into text deltas, in O(1) work per token.

    Each step decodes a small window ``tokens[prefix:]`` and emits what it adds beyond
    ``tokens[prefix:read]``.  While the window ends in U+FFFD (a multi-byte character split
    over tokens, byte-fallback pieces) nothing is emitted; the bytes come out together with the
    token that completes the character.  Decoding a window that starts a few tokens back (not
    at the new token) keeps tokenizer-specific spacing rules (SentencePiece's leading space)
    right.
    """

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True,
                 keep_ids: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        # special tokens that carry structure the caller parses (tool-call markers, channels) stay
        self.drop = special_ids(tokenizer) - keep_ids if (skip_special_tokens and keep_ids) else None
        self.tokens: list[int] = list(prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self.prefix = 0
        self.read = len(self.tokens)
        self._prefix_text = self._decode(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self.drop is not None:
            ids = [i for i in ids if i not in self.drop]
            return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Text newly completed by ``token_id`` ("" while a character is still incomplete)."""
        self.tokens.append(token_id)
        text = self._decode(self.tokens[self.prefix:])
        if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR):
            delta = text[len(self._prefix_text):]
            self.prefix, self.read = self.read, len(self.tokens)
            self._prefix_text = self._decode(self.tokens[self.prefix:self.read])
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        if self.read == len(self.tokens):
            return ""
        text = self._decode(self.tokens[self.prefix:])
        delta = text[len(self._prefix_text):]
        self.tokens = []
        self.prefix = self.read = 0
        return delta


class StopStrings:
    """Cut the output at the first stop string; never emit text that could start one.

    ``feed`` returns ``(text safe to emit, stopped)``.  A suffix of the pending text that is a
    prefix of a stop string is held back until the next delta decides it.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.pending += text
        cut = -1
        for s in self.stops:
            i = self.pending.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
