"""Chunk invariance per family, bitwise, on tiny random models: a prompt prefilled whole, in chunks
of 1, 7 or 64 tokens, or as a cached prefix plus the rest leaves the same cache (every tensor of
every layer, torch.equal) and the same logits at its last position; on the batching server a
prompt whose prefix pages come from another request (a prefix-cache hit) gives the logits of the
same prompt read cold, and those of the single-sequence route.

Families: dense (Llama, Qwen3), Qwen3-MoE, DeepSeek-V2 and V3 (MLA: prompt and decode rows on the
latent kernel, ``kernels.mla_attention``, kv_lora_rank 64 -- its narrowest latent; without it the
prompt rows go through ``mla.causal_prompt_attention``, blocks fixed from position 0, and the decode
rows through torch), Gemma-3 (a prompt past its sliding window) and Qwen3-Next (gated-DeltaNet
linear attention token by token, ``operators/cpu_linear_attention.py``: its conv and recurrent
states compared too).  The dense families' prompt attention is
the flash kernel (head_dim 64, AVX2 + FMA and up; skipped without it).  ``test_the_matrix_at_avx2`` re-runs this file at
``KT_ISA=avx2``.  Scope: docs/server.md, "Determinism"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from .test_invariance import _NoText

#: config overrides per family: head_dim 64 (the flash kernel's smallest head) where the family has
#: one; Gemma's window well inside the prompt
FAMILIES = {
    "llama": {"head_dim": 64},
    "qwen3": {"head_dim": 64},
    "qwen3_moe": {"head_dim": 64},
    "deepseek_v2": {"kv_lora_rank": 64, "qk_rope_head_dim": 16},
    "deepseek_v3": {"kv_lora_rank": 64, "qk_rope_head_dim": 16},
    "gemma3_text": {"head_dim": 64, "sliding_window": 16},
    "qwen3_next": {"head_dim": 64},
    "qwen3_5_moe_text": {"head_dim": 64},
}
MLA = ("deepseek_v2", "deepseek_v3")
#: served by the batching server's BatchRunner (pages)
PAGED = ("llama", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gemma3_text")
PROMPT_LEN = 150  # three MLA blocks of 64; Gemma's window (16) rolls many times

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cases():
    """(arch, chunk, split): chunks of 1 / 7 / 64, or a cached prefix of 70 or 128 tokens and the rest."""
    return [(arch, chunk, split) for arch in FAMILIES
            for chunk, split in [(1, None), (7, None), (64, None), (8192, 70), (8192, 128)]]


def _model(tiny, arch):
    if arch not in MLA:
        from ktransformers.operators.cpu_attention import flash_mode

        if flash_mode() is None:
            pytest.skip("no prompt flash kernel on this tier (or KT_FLASH_ATTN=0): sdpa is not chunk-invariant")
    return tiny(arch, **FAMILIES[arch])


def _prompt(seed=3, n=PROMPT_LEN):
    return [int(i) for i in np.random.default_rng(seed).integers(3, 250, n)]


def _prefill(model, ids, chunk, split=None):
    """(last-position logits, cache) of the Generator's prefill; ``split``: the first ``split``
    tokens prefilled first (a cached prefix), the rest read as one continuation."""
    from ktransformers.generation import Generator

    g = Generator(model, _NoText(), chunk_size=chunk)
    cache = g.new_cache(len(ids) + 8)
    with torch.inference_mode():
        if split:
            g.prefill(ids[:split], cache)
            last = g._forward(torch.tensor([ids[split:]]), split, cache)  # the rest, one prompt forward
        else:
            last = g.prefill(ids, cache)
    return last.clone(), cache


def _tensors(cache):
    """Every floating-point tensor the cache holds (keys, values, latents, linear-attention states),
    by (layer, attribute); bookkeeping (transformers' ``cumulative_length`` tensor is written by some
    of its paths only) is compared through ``get_seq_length``."""
    out = {}
    for i, layer in enumerate(cache.layers):
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                out[(i, name)] = value
    assert out, "the cache holds no tensors"
    return out


def _same_cache(got, want, what):
    assert got.get_seq_length() == want.get_seq_length(), what
    a, b = _tensors(got), _tensors(want)
    assert a.keys() == b.keys(), what
    for k in a:
        diff = (a[k] - b[k]).abs().max()
        assert torch.equal(a[k], b[k]), f"{what}: cache layer {k[0]} {k[1]} differs (max {diff:.3g})"


@pytest.mark.parametrize("arch,chunk,split", _cases())
def test_prefill_whole_chunked_or_after_a_prefix_gives_the_same_bits(tiny, arch, chunk, split):
    model = _model(tiny, arch)
    ids = _prompt()
    want, want_cache = _prefill(model, ids, 8192)
    got, cache = _prefill(model, ids, chunk, split)
    what = f"{arch}, " + (f"chunks of {chunk}" if split is None else f"a cached prefix of {split}")
    assert torch.equal(got, want), f"{what}: last logits differ (max {(got - want).abs().max():.3g})"
    _same_cache(cache, want_cache, what)


def _decode(model, ids, n):
    """(logits after the last of ``n`` greedy tokens, cache, the tokens): the prompt prefilled,
    then each token read by the Generator's decode step (checked to be the lean step)."""
    from ktransformers.generation import Generator

    g = Generator(model, _NoText())
    cache = g.new_cache(len(ids) + n + 8)
    step = g._decode_step()
    toks = []
    with torch.inference_mode():
        logits = g.prefill(ids, cache)
        assert step is not None and step.accepts(cache), "the decode step does not serve this model"
        for i in range(n):
            toks.append(int(logits.argmax()))
            logits = g._forward(torch.tensor([toks[-1:]]), len(ids) + i, cache)
    return logits.clone(), cache, toks


@pytest.mark.parametrize("arch", PAGED)
def test_an_answer_read_back_as_a_prompt_gives_the_decoded_bits(tiny, arch):
    """Tokens decoded one by one (the decode step's attention: a pool task per 256-key chunk) leave
    the cache and logits that the same tokens read as a prompt leave (the prompt kernel), so an
    answer found again in the prefix cache, or a preempted request read again, changes nothing.
    250 prompt tokens + 12 decoded: the decode rows cross a chunk boundary (256); Gemma's window
    (16) rolls throughout.  MLA: the latent kernel reads both."""
    model = _model(tiny, arch)
    if arch in MLA:
        from ktransformers.kernels import mla_attention_supported
        from ktransformers.operators.cpu_attention import flash_mode

        if flash_mode() is None or not mla_attention_supported(64, 16):
            pytest.skip("no latent kernel on this tier (or KT_FLASH_ATTN=0): decode rows run torch's attention")
    ids = _prompt(n=250)
    got, cache, toks = _decode(model, ids, 12)
    want, want_cache = _prefill(model, ids + toks, 8192)
    assert torch.equal(got, want), f"{arch}: the last decode logits differ from the prompt's (max {(got - want).abs().max():.3g})"
    _same_cache(cache, want_cache, f"{arch}: decoded vs read as a prompt")


def _paged_rows(model, ids, prefix_from=None, page_size=4):
    """Logits of the prompt's last position and of one greedy decode step on a BatchRunner; with
    ``prefix_from``, another request first reads ``prefix_from`` and this one starts on its full
    pages (a prefix-cache hit), reading only the rest."""
    from ktransformers.generation.paged import BatchRunner

    runner = BatchRunner(model, page_size=page_size, num_pages=256)
    start, prefix = 0, []
    if prefix_from is not None:
        runner.begin(1)
        runner.step([(1, prefix_from)], prompt={1})
        shared = 0
        while shared < min(len(ids), len(prefix_from)) and ids[shared] == prefix_from[shared]:
            shared += 1
        start = (min(shared, len(ids) - 1) // page_size) * page_size
        prefix = runner.seq_pages(1)[: start // page_size]
    runner.begin(0, prefix, start)
    last = runner.step([(0, ids[start:])], prompt={0})[0].clone()
    nxt = runner.step([(0, [int(last.argmax())])])[0].clone()
    return last, nxt


@pytest.mark.parametrize("arch", PAGED)
def test_batching_server_prefix_hit_gives_the_cold_bits(tiny, arch):
    """The batching server: a prompt on another request's prefix pages (reading 150 - 128 tokens, or
    150 - 68) gives the bits of the prompt read cold, and of the Generator's prefill; its first
    decode step too."""
    model = _model(tiny, arch)
    ids = _prompt()
    cold, cold_next = _paged_rows(model, ids)
    want, _ = _prefill(model, ids, 8192)
    assert torch.equal(cold, want[0]), f"{arch}: the batching server's prompt logits differ from the Generator's"
    for other in (ids[:130] + _prompt(5, 20), ids[:70] + _prompt(6, 90)):
        warm, warm_next = _paged_rows(model, ids, prefix_from=other)
        assert torch.equal(warm, cold), f"{arch}: a prefix hit's logits differ (max {(warm - cold).abs().max():.3g})"
        assert torch.equal(warm_next, cold_next), f"{arch}: the decode step after a prefix hit differs"


@pytest.mark.slow
def test_the_matrix_at_avx2():
    """This file again at ``KT_ISA=avx2`` (the lowest tier with the prompt flash kernel)."""
    import ktransformers.cpuinfer_ext as ext

    if os.environ.get("KT_ISA"):
        pytest.skip("already running under a forced KT_ISA")
    if "avx2" not in ext.supported_isa_tiers():
        pytest.skip("CPU does not support avx2")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not at_avx2",
                        str(Path(__file__))], env=dict(os.environ, KT_ISA="avx2"), cwd=root,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
