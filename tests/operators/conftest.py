"""Fixtures the family test modules share: each module names its architecture in ``ARCH``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def hf(request, tiny_model_dir):
    """The unmodified transformers model (fp32) of the requesting module's ``ARCH``: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(request.module.ARCH), dtype=torch.float32).eval()
