"""Speculative decoding: guess the next tokens cheaply, verify them in one step of the model.

Decode on a CPU reads every weight once per token; a step of several rows reads them once for
all of them.  A *drafter* proposes ``k`` tokens; the model runs the pending token and the ``k``
guesses as rows of one ``DecodeStep.step_rows`` (generation/decode_step.py), whose row ``r`` has
the bits a plain step would give after the tokens before it.  The longest prefix the model
agrees with is kept, plus the model's own token after it; the cache rows of the rest are undone.

Exactness: greedy answers are token for token the plain ones (the same logits, the same argmax).
When sampling, a draft token ``d`` is accepted with probability ``p(d)`` (``p`` the request's
processed distribution at that row) and otherwise a token is drawn from ``p`` without ``d``
(renormalised): the standard accept / reject rule for a deterministic draft, so each emitted token
has exactly the distribution ``p`` (the random stream differs from plain decoding; the
distribution does not).

Drafters: prompt lookup (``NgramDrafter``), the continuation of the latest earlier occurrence of
the text's last n tokens, in the prompt or the answer so far -- no extra weights, and it pays where
an answer copies (code edits, quoting summaries, JSON rewrites); a smaller model of the same
vocabulary (``DraftModelDrafter``), greedy on its own cache; and the model's own
multi-token-prediction layer (``mtp``, generation/mtp.py: DeepSeek-V3, GLM-4-MoE, Qwen3-Next, Qwen3.5).  ``Policy``
adapts the draft length to what is accepted and backs off where guesses keep failing, so plain
chat runs at plain speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

#: drafters a user can name (local_chat --speculative, Generator(speculative=...))
DRAFTERS = ("ngram", "draft", "mtp")


def check_drafter(name: str | None, draft_max: int, draft_model=None) -> None:
    """A clear error for a drafter or length the loop cannot use."""
    if name is not None and name not in DRAFTERS:
        raise ConfigError(f"--speculative {name!r}: unknown drafter (choose from ngram, mtp, draft:PATH)")
    if not 1 <= int(draft_max) <= 32:
        raise ConfigError(f"--draft_max must be between 1 and 32 (got {draft_max})")
    if (name == "draft") != (draft_model is not None):
        raise ConfigError("speculative='draft' needs a draft_model (and a draft_model needs speculative='draft')")


def parse_speculative(spec: str | None, draft_max: int, flag: str = "--speculative") -> tuple[str | None, str | None]:
    """``(drafter name, draft model path)`` of a ``--speculative`` value (``ngram`` or
    ``draft:PATH``; None: off), or a one-line error naming the flag."""
    if not 1 <= int(draft_max) <= 32:
        raise ConfigError(f"--draft_max must be between 1 and 32 (got {draft_max})")
    if spec is None:
        return None, None
    if spec in ("ngram", "mtp"):
        return spec, None
    path = spec[len("draft:"):] if spec.startswith("draft:") else None
    if not path:
        raise ConfigError(f"{flag} {spec!r}: choose ngram, mtp or draft:PATH")
    from pathlib import Path

    try:
        found = Path(path).exists()
    except (OSError, ValueError):  # a NUL byte, a name too long for the file system
        found = False
    if not found:
        shown = path if path.isprintable() else path.encode("unicode_escape").decode("ascii")
        raise ConfigError(f"{flag} draft:{shown}: no such file or directory")
    return "draft", path


class NgramDrafter:
    """Prompt lookup over the tokens so far.

    For n from ``ngram_max`` down to ``ngram_min``, the last n tokens are looked up among the
    earlier n-grams; the tokens that followed the latest earlier occurrence are the draft.  The
    index (n-gram -> where its continuation starts) grows by one entry per n with each token, so a
    lookup costs a few dict reads whatever the length of the text.
    """

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4):
        if not 1 <= ngram_min <= ngram_max:
            raise ConfigError(f"ngram sizes must satisfy 1 <= min <= max (got {ngram_min}, {ngram_max})")
        self.ngram_min, self.ngram_max = int(ngram_min), int(ngram_max)
        self.tokens: list[int] = []
        self._index: list[dict[tuple, int]] = [dict() for _ in range(self.ngram_max + 1)]

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(int(t))

    def append(self, token: int) -> None:
        toks = self.tokens
        toks.append(token)
        end = len(toks) - 1  # the n-grams ending just before this token continue with it
        for n in range(self.ngram_min, self.ngram_max + 1):
            if end >= n:
                self._index[n][tuple(toks[end - n:end])] = end

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the last occurrence of the text's suffix (longest n first)."""
        toks = self.tokens
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(toks) <= n:
                continue
            start = self._index[n].get(tuple(toks[-n:]))
            if start is not None:
                return toks[start:start + k]
        return []


class Policy:
    """How many tokens to draft next, from what was accepted so far.

    The length follows the last accepted run (doubling after a verify that kept everything,
    falling to one past the accepted count otherwise); after a verify that kept nothing, drafting
    pauses for a number of tokens that doubles with each such miss in a row (up to 64), so a
    conversation that does not repeat itself pays for a guess only now and then.
    """

    def __init__(self, draft_max: int):
        self.draft_max = int(draft_max)
        self.k = max(1, self.draft_max // 2)
        self.misses = 0
        self.pause = 0

    def next_k(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        if accepted == 0:
            self.misses += 1
            self.pause = min(64, 2 ** (self.misses - 1))
            self.k = 1
        else:
            self.misses = 0
            self.k = min(self.draft_max, 2 * self.k if accepted == drafted else accepted + 1)


@dataclass
class SpeculativeStats:
    """Drafted and accepted tokens of one request (``acceptance`` = accepted / drafted)."""

    drafted: int = 0
    accepted: int = 0
    verifies: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class DraftModelDrafter:
    """Guesses from a smaller model of the same vocabulary, greedy, on its own cache.

    The draft model follows the text: before each draft it is fed the tokens emitted since the last
    one (its guesses the target kept are already in its cache; the rows of the others are undone),
    then it guesses ``k`` tokens one step at a time.  Its steps are the target's kind of step
    (``DecodeStep.step_rows``), so its cache can be rewound the same way; a draft model the step
    does not serve is refused when it is named.
    """

    def __init__(self, draft, capacity: int):
        """``draft``: a ``Generator`` of the draft model (its prompt forward and cache)."""
        from .decode_step import decode_step_for

        self.step = decode_step_for(draft.model)
        if self.step is None:
            raise ConfigError(f"draft model {type(draft.model).__name__}: its family is not served by the decode "
                              "step (Gemma-3 text, Llama / Mistral / Qwen2 / Qwen3, Qwen-MoE, DeepSeek MLA), so it "
                              "cannot draft")
        self.gen = draft
        self.capacity = int(capacity)
        self.tokens: list[int] = []   # the text so far (prompt and emitted tokens)
        self.fed: list[int] = []      # tokens in the draft cache, in order
        self.guessed: list = []       # undo of each guess fed since the last draft (after the confirmed rows)
        self.cache = None
        self.logits = None            # the draft's logits after its last fed token
        self.broken = False

    def extend(self, tokens) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def append(self, token: int) -> None:
        self.tokens.append(int(token))

    def _feed(self, tokens: list[int], keep: bool) -> bool:
        got = self.step.step_rows(tokens, len(self.fed), self.cache)
        if got is None:
            self.broken = True  # a cache state the step does not take: stop guessing
            return False
        logits, undo = got
        self.logits = logits[-1:]
        self.fed.extend(tokens)
        if not keep:
            self.guessed.append(undo)
        return True

    def draft(self, k: int) -> list[int]:
        import torch

        from .sampling import argmax_rows

        if k <= 0 or self.broken:
            return []
        with torch.inference_mode():
            if self.cache is None:  # the prompt, as the target read it: whole, on the draft's own cache
                self.cache = self.gen.new_cache(self.capacity)
                self.logits = self.gen.prefill(self.tokens, self.cache)
                self.fed = list(self.tokens)
            else:
                # keep the guesses the target accepted, undo the rest (latest first)
                base = len(self.fed) - len(self.guessed)
                same = base
                while same < len(self.fed) and same < len(self.tokens) and self.fed[same] == self.tokens[same]:
                    same += 1
                for undo in reversed(self.guessed[same - base:]):
                    undo(0)
                del self.fed[same:]
                self.guessed = []
                rest = self.tokens[same:]
                if rest and not self._feed(rest, keep=True):
                    return []
            out = []
            while len(out) < k and len(self.fed) < self.capacity:
                out.append(argmax_rows(self.logits)[0])
                if len(out) < k and not self._feed([out[-1]], keep=False):
                    break
        return out


def make_drafter(name: str, draft=None, capacity: int = 0, model=None, step=None, prompt_hidden=None):
    """The drafter ``name`` for one request (``draft``: the draft model's ``Generator``; ``mtp``: the
    model, its decode step and the prompt's final hidden states)."""
    if name == "ngram":
        return NgramDrafter()
    if name == "draft":
        return DraftModelDrafter(draft, capacity)
    if name == "mtp":
        from .mtp import MTPDrafter

        return MTPDrafter(model, step, prompt_hidden)
    raise ConfigError(f"unknown drafter {name!r} (choose from ngram, mtp, draft:PATH)")
