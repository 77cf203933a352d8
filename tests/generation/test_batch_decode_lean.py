"""The decode step over the page pool (``DecodeStep.step_pages``) against the generic BatchRunner step.

Two runners over the same model get the same chunks step by step: one takes the lean step on every
decode-only step, the other (``lean_decode = False``) the generic transformers forward with the
``kt_paged`` attention.  Tolerance: max |Δlogits| <= 1e-5 x max |logits| on every step (tiny fp32
models: F32 weights on the CPU kernels, no activation quantisation; the two differ only in the order
of the attention and norm sums).  Each test also asserts the lean step really ran on the decode-only
steps (so a silent fallback cannot pass for equality).
"""

from __future__ import annotations

import pytest
import torch

from ktransformers.generation.decode_step import decode_step_for
from ktransformers.generation.paged import BatchRunner

from .conftest import tiny_loader

TOL = 1e-5
LEAN_ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "gemma3_text", "deepseek_v2", "deepseek_v3",
              "glm4_moe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny models of this file's own (seed 0): the tests wrap their decode step."""
    return tiny_loader(tmp_path_factory, seed=0, prefix="lean-batch")


def _prompt(n, seed):
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Counting:
    """Counts the decode step's page-pool calls on a model (its one ``DecodeStep``, wrapped)."""

    def __init__(self, runner):
        self.calls = 0
        step = decode_step_for(runner.model)
        assert step is not None and step.pages_of(runner.pool) is not None, "the decode step should serve this model"
        inner = step.step_pages

        def counted(*a, **kw):
            self.calls += 1
            return inner(*a, **kw)

        step.step_pages = counted


def _twins(model, page_size=4, num_pages=64):
    lean = BatchRunner(model, page_size=page_size, num_pages=num_pages)
    generic = BatchRunner(model, page_size=page_size, num_pages=num_pages)
    generic.lean_decode = False
    return lean, generic, _Counting(lean)


def _compare(lean, generic, chunks, worst):
    a, b = lean.step(chunks), generic.step(chunks)
    assert a.shape == b.shape
    err = ((a - b).abs().max() / b.abs().max()).item()
    worst[0] = max(worst[0], err)
    return b


def _drive(lean, generic, prompts, *, starts, new, prefix=None):
    """Prompt ``i`` begins at step ``starts[i]`` (its whole prompt as one chunk next to the others'
    decode tokens), then decodes ``new`` greedy tokens; ``prefix = {i: (j, n_pages)}``: sequence ``i``
    begins on the first ``n_pages`` pages of sequence ``j`` (which must have them by then) and
    prefills only the rest of its prompt.  Returns the worst relative logit difference."""
    worst = [0.0]
    last, made, pending = {}, {}, {}
    step = 0
    while step < max(starts) + 1 or any(made[i] < new for i in made):
        for i, s in enumerate(starts):
            if s != step:
                continue
            ids = prompts[i]
            if prefix and i in prefix:
                j, n = prefix[i]
                for r in (lean, generic):
                    pages = r.seq_pages(j)[:n]
                    r.begin(i, pages, n * r.page_size)
                ids = ids[n * lean.page_size :]
            else:
                for r in (lean, generic):
                    r.begin(i)
            pending[i] = ids
            made[i] = 0
        chunks = []
        for i in sorted(made):
            if pending.get(i):
                chunks.append((i, pending.pop(i)))
            elif made[i] < new:
                chunks.append((i, [last[i]]))
        if chunks:
            logits = _compare(lean, generic, chunks, worst)
            for (i, _), row in zip(chunks, logits):
                last[i] = int(row.argmax())
                made[i] += 1
        step += 1
    for r in (lean, generic):
        for i in list(r.sequences()):
            r.release(i)
        assert r.pool.free_count() == r.pool.num_pages
    return worst[0]


@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_lean_batched_step_equals_generic(arch, models, one_torch_thread):
    model = models(arch)
    lean, generic, count = _twins(model)
    prompts = [_prompt(n, seed) for seed, n in enumerate((5, 13, 9, 20))]
    worst = _drive(lean, generic, prompts, starts=[0, 0, 3, 6], new=14)
    assert count.calls > 0, f"{arch}: no decode-only step took the lean path"
    assert worst <= TOL, f"{arch}: lean batched step off the generic step by {worst:.2e} x max|logits|"


def test_gemma_window_layers_past_the_window(models, one_torch_thread):
    """A full and a sliding layer; contexts of 2-4x the window of 8 in the same step."""
    model = models("gemma3_text", layer_types=["sliding_attention", "full_attention"])
    assert model.config.get_text_config().layer_types == ["sliding_attention", "full_attention"]
    lean, generic, count = _twins(model)
    step = decode_step_for(model)
    assert step.layers[0].window == 8 and step.layers[1].window == 0
    prompts = [_prompt(n, 10 + n) for n in (17, 3, 30)]
    worst = _drive(lean, generic, prompts, starts=[0, 0, 1], new=12)
    assert count.calls >= 10
    assert worst <= TOL, f"gemma3: {worst:.2e}"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "deepseek_v3"])
def test_sequences_sharing_prefix_pages(arch, models, one_torch_thread):
    model = models(arch)
    lean, generic, count = _twins(model, page_size=4)
    base = _prompt(14, 3)
    prompts = [base, base[:12] + _prompt(5, 4), base[:8] + _prompt(2, 5)]
    # sequence 1 reads sequence 0's first 3 pages, sequence 2 its first 2, all decoding together
    worst = _drive(lean, generic, prompts, starts=[0, 1, 1], new=10, prefix={1: (0, 3), 2: (0, 2)})
    assert count.calls > 0
    assert worst <= TOL, f"{arch}: {worst:.2e}"


def test_shared_pages_are_never_written(models, one_torch_thread):
    model = models("llama")
    runner = BatchRunner(model, page_size=4, num_pages=32)
    _Counting(runner)
    runner.begin(0)
    runner.step([(0, _prompt(9, 1))])
    shared = runner.seq_pages(0)[:2]
    before = {p: runner.pool.read_page(p) for p in shared}
    runner.begin(1, shared, 8)
    runner.step([(1, _prompt(3, 2))])
    for _ in range(6):
        runner.step([(0, [1]), (1, [2])])
    for p in shared:
        for name, t in runner.pool.read_page(p).items():
            assert torch.equal(t, before[p][name]), f"shared page {p} changed in {name}"


def test_env_switch_and_unserved_models(models, monkeypatch, one_torch_thread):
    monkeypatch.setenv("KT_LEAN_DECODE", "0")
    assert BatchRunner(models("llama"), page_size=4, num_pages=8).lean_decode is False
    monkeypatch.delenv("KT_LEAN_DECODE")
    # a family the decode step does not serve: the generic step
    mx = models("mixtral")
    runner = BatchRunner(mx, page_size=4, num_pages=16)
    assert decode_step_for(mx) is None
    runner.begin(0)
    runner.step([(0, _prompt(5, 0))])
    assert runner.step([(0, [7])]).shape == (1, mx.config.vocab_size)


def test_rows_above_the_prefill_threshold_take_the_generic_step(models, one_torch_thread, monkeypatch):
    model = models("llama")
    lean, generic, count = _twins(model, num_pages=64)
    monkeypatch.setattr(decode_step_for(model), "max_rows", 2)
    prompts = [_prompt(4 + i, 20 + i) for i in range(3)]
    worst = _drive(lean, generic, prompts, starts=[0, 0, 0], new=4)
    assert count.calls == 0  # every decode step had 3 rows
    assert worst <= TOL


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


@pytest.mark.parametrize("positions", [[300, 0, 37, 15], [300]])  # one row on 2 threads: its keys are split
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window,qk_norm", [(0, False), (0, True), (24, False)])
def test_paged_decode_attention_against_torch(positions, threads, window, qk_norm):
    """decode_ops.attend_rows over pages alone against torch: GQA, scattered pages, per-row positions,
    q/k norm, sliding window, keys split across threads; the new K/V land in their slots."""
    from ktransformers import cpuinfer_ext
    from ktransformers.kernels.pool import cpu_infer

    n = len(positions)
    g = torch.Generator().manual_seed(threads * 7 + window + qk_norm + n)
    hq, hkv, d, S, eps, scale = 8, 2, 32, 16, 1e-6, 0.17
    need = [p // S + 1 for p in positions]
    perm = torch.randperm(sum(need) + 5, generator=g)  # pages out of order, some unused
    tables, at = [], 0
    for k in need:
        tables.append(perm[at : at + k].tolist())
        at += k
    slots = (sum(need) + 5) * S
    keys, values = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    k0, v0 = keys.clone(), values.clone()
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    qkv_in = qkv.clone()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.tensor(positions).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos().contiguous(), torch.cat([ang, ang], -1).sin().contiguous()
    w = (torch.rand(hq + hkv, d, generator=g) + 0.5).contiguous()
    pages = torch.tensor([p for t in tables for p in t], dtype=torch.long)
    offs = torch.tensor([0] + torch.tensor(need).cumsum(0).tolist(), dtype=torch.long)
    pos = torch.tensor(positions, dtype=torch.long)
    lo = (pos - window + 1).clamp(min=0) if window else torch.zeros_like(pos)
    out = torch.empty(n, hq * d)
    cpuinfer_ext.decode_ops.attend_rows(
        cpu_infer(threads)._c, qkv.data_ptr(), n, hq, hkv, d, w.data_ptr() if qk_norm else 0, eps, cos.data_ptr(),
        sin.data_ptr(), keys.data_ptr(), values.data_ptr(), hkv * d, d, S, pages.data_ptr(), offs.data_ptr(),
        pos.data_ptr(), lo.data_ptr(), 0, 0, 0, scale, out.data_ptr())

    heads = qkv_in.view(n, hq + 2 * hkv, d)
    qk = heads[:, : hq + hkv]
    if qk_norm:
        qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps) * w
    qk = qk * cos[:, None] + _rotate_half(qk) * sin[:, None]
    q, k, v = qk[:, :hq], qk[:, hq:], heads[:, hq + hkv :]
    for r, (p, table) in enumerate(zip(positions, tables)):
        rows = torch.tensor([table[j // S] * S + j % S for j in range(p + 1)])
        k0[rows[-1]], v0[rows[-1]] = k[r], v[r]
        lo = max(0, p - window + 1) if window else 0
        kk, vv = k0[rows[lo:]], v0[rows[lo:]]  # [L, hkv, d]
        kk, vv = kk.repeat_interleave(hq // hkv, 1), vv.repeat_interleave(hq // hkv, 1)
        att = torch.softmax(torch.einsum("hd,lhd->hl", q[r], kk) * scale, -1)
        want = torch.einsum("hl,lhd->hd", att, vv).reshape(-1)
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, k0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, v0, rtol=0, atol=0)
