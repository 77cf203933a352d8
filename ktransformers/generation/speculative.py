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

The drafter here is prompt lookup (``NgramDrafter``): the continuation of the latest earlier
occurrence of the text's last n tokens, in the prompt or the answer so far -- no extra weights,
and it pays where an answer copies (code edits, quoting summaries, JSON rewrites).  ``Policy``
adapts the draft length to what is accepted and backs off where guesses keep failing, so plain
chat runs at plain speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

#: drafters a user can name (local_chat --speculative, Generator(speculative=...))
DRAFTERS = ("ngram",)


def check_drafter(name: str | None, draft_max: int) -> None:
    """A clear error for a drafter or length the loop cannot use."""
    if name is not None and name not in DRAFTERS:
        raise ConfigError(f"--speculative {name!r}: unknown drafter (choose from {', '.join(DRAFTERS)})")
    if not 1 <= int(draft_max) <= 32:
        raise ConfigError(f"--draft_max must be between 1 and 32 (got {draft_max})")


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


def make_drafter(name: str):
    if name == "ngram":
        return NgramDrafter()
    raise ConfigError(f"unknown drafter {name!r} (choose from {', '.join(DRAFTERS)})")
