"""A tiny Qwen3-VL-MoE written once per session (random weights, its processor and tokenizer) and a
photo-like image drawn here: a sky gradient, a sun, a ground of noisy texture."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def photo_like(width: int = 90, height: int = 60, seed: int = 0):
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height)[:, None, None]
    sky = (1 - y) * np.array([90, 150, 230]) + y * np.array([200, 220, 250])
    arr = np.broadcast_to(sky, (height, width, 3)).copy()
    ground = height * 2 // 3
    arr[ground:] = np.array([70, 120, 50]) + rng.normal(0, 18, (height - ground, width, 3))
    img = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    ImageDraw.Draw(img).ellipse((width * 0.65, height * 0.1, width * 0.85, height * 0.4), fill=(250, 230, 120))
    return img.filter(ImageFilter.GaussianBlur(0.8))


@pytest.fixture(scope="session")
def tiny_vl(tiny_model_dir):
    return tiny_model_dir("qwen3_vl_moe")


@pytest.fixture(scope="module")
def vl(tiny_vl):
    """(tokenizer, image support, transformers' model, the loaded model) of the tiny Qwen3-VL-MoE."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from ktransformers import load_model
    from ktransformers.multimodal.chat import image_support

    tok = AutoTokenizer.from_pretrained(tiny_vl)
    support = image_support(AutoConfig.from_pretrained(tiny_vl), tok, tiny_vl)
    hf = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    model = load_model(tiny_vl, model_path=tiny_vl, allow_unmatched=False)
    return tok, support, hf, model


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield
