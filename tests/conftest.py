"""Shared fixtures: tiny models written once per session, and the shared reference data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT.parent / "shared" / "fixtures"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# packed expert weights made by tests are cached in a folder of this run, never in ~/.cache
if "KT_PACKED_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["KT_PACKED_CACHE"] = tempfile.mkdtemp(prefix="kt-packed-cache-")
    atexit.register(shutil.rmtree, os.environ["KT_PACKED_CACHE"], True)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip(f"reference fixtures not found at {FIXTURES} (they sit beside the project root as shared/fixtures)")
    return FIXTURES


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(arch)`` → folder with a tiny random model of ``arch`` (written once)."""
    from ktransformers.util.tiny_models import write_tiny_model

    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            d = tmp_path_factory.mktemp(f"tiny-{arch}")
            write_tiny_model(arch, d, seed=0)
            made[arch] = d
        return made[arch]

    return get


@pytest.fixture
def one_torch_thread():
    """For files of small models: one intra-op thread beats two on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
