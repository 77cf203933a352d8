"""Torch's intra-op threads around the kernel pool: the pool's share between decode steps, every
physical core during a prefill forward (``install_prefill_threads``), and back after it."""

from __future__ import annotations

import pytest
import torch

from ktransformers import load_model
from ktransformers.operators import cpu_threads


@pytest.fixture
def model_and_seen(tiny_model_dir, monkeypatch):
    """A tiny Qwen3-MoE through the shipped -cpu rules, and the torch thread count each forward of
    its first decoder layer saw."""
    monkeypatch.delenv("KT_TORCH_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    model = load_model(tiny_model_dir("qwen3_moe"), device="cpu")
    seen: list[int] = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    yield model, seen
    torch.set_num_threads(before)


def test_prefill_forward_gets_every_core(model_and_seen, monkeypatch):
    model, seen = model_and_seen
    cores = cpu_threads.physical_cores()
    monkeypatch.setattr(cpu_threads, "_claimed", True)  # as once the kernel pool took its cores
    torch.set_num_threads(1)
    n = cpu_threads.PREFILL_TORCH_TOKENS
    with torch.no_grad():
        model(torch.arange(n).unsqueeze(0) % 100)
        assert torch.get_num_threads() == 1  # restored
        model(torch.arange(n - 1).unsqueeze(0) % 100)  # below the prefill size: unchanged
    assert seen == [cores, 1]


def test_prefill_threads_restored_when_the_forward_fails(model_and_seen, monkeypatch):
    model, seen = model_and_seen
    monkeypatch.setattr(cpu_threads, "_claimed", True)
    torch.set_num_threads(1)

    def fail(module, args):
        raise RuntimeError("boom")

    model.model.layers[1].register_forward_pre_hook(fail)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        model(torch.zeros(1, cpu_threads.PREFILL_TORCH_TOKENS, dtype=torch.long))
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("var", ["KT_TORCH_THREADS", "OMP_NUM_THREADS"])
def test_an_explicit_thread_count_is_kept(model_and_seen, monkeypatch, var):
    model, seen = model_and_seen
    monkeypatch.setattr(cpu_threads, "_claimed", True)
    monkeypatch.setenv(var, "1")
    torch.set_num_threads(1)
    with torch.no_grad():
        model(torch.zeros(1, cpu_threads.PREFILL_TORCH_TOKENS, dtype=torch.long))
    assert seen == [1]


def test_cpu_infer_sets_the_pool_and_torch(monkeypatch):
    """``--cpu_infer`` (local_chat, the server, sft): the kernels' pool size and torch's threads
    until the pool takes its cores; no value: physical cores."""
    monkeypatch.setattr(cpu_threads, "_threads", None)
    before = torch.get_num_threads()
    try:
        cpu_threads.use_threads(3)
        assert cpu_threads.cpu_infer_threads() == 3 and torch.get_num_threads() == 3
        cpu_threads.use_threads(None)
        assert cpu_threads.cpu_infer_threads() == cpu_threads.physical_cores() == torch.get_num_threads()
        with pytest.raises(ValueError, match="--cpu_infer must be at least 1"):
            cpu_threads.use_threads(-1)
    finally:
        torch.set_num_threads(before)
