import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """These tests are small: one intra-op thread is faster than two on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
