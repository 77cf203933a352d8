"""The fuzz tests' example counts: CI's small ones, or ``KT_FUZZ_EXAMPLES`` for a fresh campaign."""

from __future__ import annotations

import os

from hypothesis import settings


def fuzz_settings(max_examples: int, **kwargs) -> settings:
    """Hypothesis ``settings`` with ``max_examples`` as CI runs them.  ``KT_FUZZ_EXAMPLES=N`` runs N
    examples a test instead, not derandomized, so that ``--hypothesis-seed`` picks new ones."""
    wanted = os.environ.get("KT_FUZZ_EXAMPLES", "").strip()
    if wanted:
        if not wanted.isdigit() or int(wanted) < 1:
            raise ValueError(f"KT_FUZZ_EXAMPLES={wanted!r}: give a whole number of examples, at least 1")
        max_examples, kwargs["derandomize"] = int(wanted), False
    return settings(max_examples=max_examples, **kwargs)
