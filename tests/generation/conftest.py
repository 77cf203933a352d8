"""Fixtures shared by the generation tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``tiny(arch, **config overrides)`` -> a tiny random model of ``arch`` (seed 2), written and
    loaded with its shipped rules once per session."""
    from ktransformers import load_model
    from ktransformers.util.tiny_models import write_tiny_model

    made = {}

    def get(arch, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in made:
            d = tmp_path_factory.mktemp(f"tiny-{arch}")
            write_tiny_model(arch, d, seed=2, **overrides)
            made[key] = load_model(d, model_path=d)
        return made[key]

    return get
