"""Fixtures shared by the generation tests."""

from __future__ import annotations

import pytest


def tiny_loader(tmp_path_factory, seed: int, prefix: str = "tiny"):
    """``get(arch, **config overrides)`` -> a tiny random model of ``arch`` (``seed``), written and
    loaded with its shipped rules once per loader."""
    from ktransformers import load_model
    from ktransformers.util.tiny_models import write_tiny_model

    made = {}

    def get(arch, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in made:
            d = tmp_path_factory.mktemp(f"{prefix}-{arch}")
            write_tiny_model(arch, d, seed=seed, **overrides)
            made[key] = load_model(d, model_path=d)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``tiny(arch, **config overrides)`` -> a tiny random model of ``arch`` (seed 2), written and
    loaded with its shipped rules once per session."""
    return tiny_loader(tmp_path_factory, seed=2)
