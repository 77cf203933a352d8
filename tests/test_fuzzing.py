"""The fuzz tests' example-count knob."""

import pytest
from fuzzing import fuzz_settings


def test_ci_counts_by_default(monkeypatch):
    monkeypatch.delenv("KT_FUZZ_EXAMPLES", raising=False)
    s = fuzz_settings(40, derandomize=True, deadline=None)
    assert (s.max_examples, s.derandomize, s.deadline) == (40, True, None)


def test_campaign_count_and_fresh_seeds(monkeypatch):
    monkeypatch.setenv("KT_FUZZ_EXAMPLES", "5000")
    s = fuzz_settings(40, derandomize=True)
    assert (s.max_examples, s.derandomize) == (5000, False)


@pytest.mark.parametrize("value", ["0", "-3", "lots", "1e3"])
def test_bad_count_named(monkeypatch, value):
    monkeypatch.setenv("KT_FUZZ_EXAMPLES", value)
    with pytest.raises(ValueError, match=f"KT_FUZZ_EXAMPLES='{value}'"):
        fuzz_settings(40)
