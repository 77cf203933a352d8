import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These tests are small: one intra-op thread (see tests/conftest.py)."""
    yield
