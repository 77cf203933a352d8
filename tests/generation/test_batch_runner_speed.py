"""The point of batching: one step for 8 decoding sequences costs far less than 8 single steps.

On the tiny Qwen3-MoE (CPU experts) a decode step is almost all per-op dispatch, which a batched
step pays once.  Measured on 2 shared cores: N=8 costs 1.1-1.4x N=1 (Llama, Qwen3-MoE, DeepSeek-V2, Gemma-3).  The bound (half of
8 single steps) leaves room for a loaded machine; timings are interleaved and the best of several
rounds is kept so that load drifting during the test hits both sides alike.
"""

from __future__ import annotations

import time

import torch

from ktransformers import load_model
from ktransformers.generation.paged import BatchRunner


def _decode_ms(runner, ids, last, steps=6):
    t = time.perf_counter()
    for _ in range(steps):
        logits = runner.step([(i, [last[i]]) for i in ids])
        for i, row in zip(ids, logits):
            last[i] = int(row.argmax())
    return (time.perf_counter() - t) / steps * 1e3


def test_batched_decode_step_costs_less_than_separate_steps(tiny_model_dir, one_torch_thread):
    d = tiny_model_dir("qwen3_moe")
    model = load_model(d, model_path=d)
    runner = BatchRunner(model, page_size=16, num_pages=64)
    last = {}
    for i in range(8):
        runner.begin(i)
        prompt = torch.randint(0, 300, (24 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()
        last[i] = int(runner.step([(i, prompt)])[0].argmax())
    one, eight = [], []
    for _ in range(5):
        one.append(_decode_ms(runner, [0], last))
        eight.append(_decode_ms(runner, list(range(8)), last))
    t1, t8 = min(one), min(eight)
    assert t8 < 0.5 * 8 * t1, f"8 sequences: {t8:.2f} ms per step, 1 sequence: {t1:.2f} ms"
