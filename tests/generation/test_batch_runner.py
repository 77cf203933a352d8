"""BatchRunner: sequences interleaved in one forward per step == each sequence alone.

Reference: the same injected model run alone per prompt, ``model.generate`` (greedy tokens) and one
full forward over prompt + continuation (logits at every generated position).  fp32 tolerance:
max |Δlogits| <= 1e-4 x max |logits| (the batched attention sums in another order and over
padded/masked key sets; nothing else differs).
"""

from __future__ import annotations

import pytest
import torch

from ktransformers import load_model
from ktransformers.generation.paged import PAGED_ATTENTION, BatchRunner, OutOfPages
from ktransformers.util.tiny_models import TINY_CONFIGS, VISION_ARCHS

# every family with softmax or MLA attention: GQA (llama, qwen*), CPU experts (qwen3_moe, mixtral, ...),
# MLA latent pages (deepseek_v2/v3), sliding window (gemma3_text)
#: linear attention (Qwen3.5-MoE, Qwen3-Next), attention sinks (gpt-oss) and the sparse-attention indexer
#: (DeepSeek-V3.2, GLM-5) and compressed KV (DeepSeek-V4) are refused by name (test below; the indexer in
#: tests/operators/test_deepseek_v32.py, compressed KV in tests/operators/test_deepseek_v4.py)
ARCHS = [a for a in TINY_CONFIGS if a not in ("qwen3_5_moe_text", "qwen3_next", "gpt_oss", "deepseek_v32",
                                              "glm_moe_dsa", "deepseek_v4") and a not in VISION_ARCHS]
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    made = {}

    def get(arch):
        if arch not in made:
            d = tiny_model_dir(arch)
            made[arch] = load_model(d, model_path=d)
        return made[arch]

    return get


def _prompt(n, seed):
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(model, prompt, new):
    """Greedy continuation and the logits that chose each token, from the single-request path."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    toks = out[0, len(prompt):].tolist()
    with torch.no_grad():
        logits = model(out).logits[0, len(prompt) - 1 : -1].float()
    return toks, logits


def _drive(runner, prompts, *, starts, new, chunk, release_after=None):
    """Run ``prompts`` through ``runner``: prompt ``i`` begins at step ``starts[i]``, its prompt goes in
    chunks of ``chunk`` tokens next to the others' decode tokens; ``release_after = (i, k)`` releases
    sequence ``i`` once it has ``k`` tokens.  Returns per sequence (tokens, logits rows)."""
    toks = {i: [] for i in range(len(prompts))}
    rows = {i: [] for i in range(len(prompts))}
    pending = {}
    done = set()
    step = 0
    while len(done) < len(prompts):
        for i, s in enumerate(starts):
            if s == step:
                runner.begin(100 + i)
                pending[i] = list(prompts[i])
        chunks = []
        for i in pending:
            if i in done:
                continue
            chunks.append((100 + i, pending[i][:chunk] if pending[i] else [toks[i][-1]]))
        if chunks:
            logits = runner.step(chunks)
            for (sid, sent), row in zip(chunks, logits):
                i = sid - 100
                if pending[i]:
                    pending[i] = pending[i][len(sent):]
                    if pending[i]:
                        continue
                toks[i].append(int(row.argmax()))
                rows[i].append(row)
                if len(toks[i]) == new or (release_after and release_after == (i, len(toks[i]))):
                    runner.release(sid)
                    done.add(i)
        step += 1
        assert step < 500
    return {i: (toks[i], torch.stack(rows[i])) for i in toks}


@pytest.mark.parametrize("arch", ARCHS)
def test_interleaved_equals_alone(arch, models, one_torch_thread):
    model = models(arch)
    lengths = [5, 19, 11, 27, 3]
    prompts = [_prompt(n, seed=i) for i, n in enumerate(lengths)]
    new = 10
    runner = BatchRunner(model, page_size=4, num_pages=64)
    got = _drive(runner, prompts, starts=[0, 0, 2, 3, 7], new=new, chunk=6, release_after=(2, 4))
    for i, p in enumerate(prompts):
        want_toks, want_logits = _alone(model, p, new)
        toks, logits = got[i]
        n = len(toks)
        assert toks == want_toks[:n], f"sequence {i} (prompt {len(p)} tokens) diverged"
        scale = want_logits.abs().max().item()
        assert (logits - want_logits[:n]).abs().max().item() <= TOL * scale
    assert len(got[2][0]) == 4  # released midway
    assert runner.pool.free_count() == runner.pool.num_pages
    # the single-request path is untouched
    assert model.config._attn_implementation != PAGED_ATTENTION
    if arch == "gemma3_text":
        assert max(lengths) + new > model.config.sliding_window  # the window is exercised


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2", "gemma3_text"])
def test_prefix_pages_give_cold_logits(arch, models, one_torch_thread):
    model = models(arch)
    S = 4
    shared = _prompt(13, seed=1)
    tail_a, tail_b = _prompt(3, seed=2), _prompt(6, seed=3)
    runner = BatchRunner(model, page_size=S, num_pages=32)
    runner.begin(1)
    runner.step([(1, shared + tail_a)])
    prefix_len = (len(shared) // S) * S
    prefix = runner.seq_pages(1)[: prefix_len // S]
    before = [runner.pool.read_page(p) for p in prefix]

    runner.begin(2, prefix, prefix_len)
    assert [runner.pool.refcount(p) for p in prefix] == [2] * len(prefix)
    assert runner.seq_len(2) == prefix_len
    warm = runner.step([(2, (shared + tail_b)[prefix_len:]), (1, [7])])[0]
    warm_next = runner.step([(2, [5])])[0]
    runner.begin(3)
    cold = runner.step([(3, shared + tail_b)])[0]
    cold_next = runner.step([(3, [5])])[0]
    scale = cold.abs().max().item()
    assert (warm - cold).abs().max().item() <= TOL * scale
    assert (warm_next - cold_next).abs().max().item() <= TOL * scale
    for p, b in zip(prefix, before):  # shared pages are read-only
        after = runner.pool.read_page(p)
        assert all(torch.equal(after[k], b[k]) for k in b)
    runner.release(1)
    assert [runner.pool.refcount(p) for p in prefix] == [1] * len(prefix)
    runner.release(2)
    runner.release(3)
    assert runner.pool.free_count() == runner.pool.num_pages


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_pages_round_trip_through_read_write(arch, models, one_torch_thread):
    """A page copied out (read_page) and into another pool (write_page) serves as a prefix there."""
    model = models(arch)
    S = 4
    ids = _prompt(17, seed=4)
    src = BatchRunner(model, page_size=S, num_pages=16)
    src.begin(1)
    src.step([(1, ids[:16])])
    payloads = [src.pool.read_page(p) for p in src.seq_pages(1)]
    assert all(t.device.type == "cpu" and t.shape[0] == S for pl in payloads for t in pl.values())

    dst = BatchRunner(model, page_size=S, num_pages=16)
    pages = dst.pool.reserve(4)
    for p, pl in zip(pages, payloads):
        dst.pool.write_page(p, pl)
    assert all(torch.equal(dst.pool.read_page(p)[k], pl[k]) for p, pl in zip(pages, payloads) for k in pl)
    dst.begin(7, pages, 16)
    for p in pages:  # the runner holds its own reference now
        dst.pool.decref(p)
    warm = dst.step([(7, ids[16:])])[0]
    cold = src.step([(1, ids[16:])])[0]
    assert (warm - cold).abs().max().item() <= TOL * cold.abs().max().item()
    dst.release(7)
    assert dst.pool.free_count() == dst.pool.num_pages


def test_write_page_names_the_bad_tensor(models):
    runner = BatchRunner(models("llama"), page_size=4, num_pages=4)
    page = runner.pool.alloc()
    good = runner.pool.read_page(page)
    with pytest.raises(ValueError, match="layers.0.key"):
        runner.pool.write_page(page, {**good, "layers.0.key": good["layers.0.key"][:2]})
    with pytest.raises(ValueError, match="missing"):
        runner.pool.write_page(page, {k: v for k, v in good.items() if k != "layers.1.value"})
    with pytest.raises(ValueError, match="out of range"):
        runner.pool.read_page(4)


def test_out_of_pages_leaves_state_unchanged(models, one_torch_thread):
    model = models("qwen3_moe")
    runner = BatchRunner(model, page_size=4, num_pages=5)
    runner.begin(1)
    runner.begin(2)
    runner.step([(1, _prompt(6, 5)), (2, _prompt(7, 6))])  # 2 + 2 pages
    state = (runner.seq_len(1), runner.seq_len(2), runner.seq_pages(1), runner.seq_pages(2), runner.pool.free_count())
    assert runner.pages_needed(1, 3) == 1 and runner.pages_needed(2, 6) == 2
    with pytest.raises(OutOfPages):
        runner.step([(1, [1, 2, 3]), (2, [4, 5, 6, 7, 8, 9])])  # needs 3, 1 free
    assert (runner.seq_len(1), runner.seq_len(2), runner.seq_pages(1), runner.seq_pages(2),
            runner.pool.free_count()) == state
    # the failed step left no trace: the next step gives what a fresh runner gives
    got = runner.step([(1, [1, 2, 3])])[0]
    ref = BatchRunner(model, page_size=4, num_pages=5)
    ref.begin(1)
    ref.step([(1, _prompt(6, 5))])
    want = ref.step([(1, [1, 2, 3])])[0]
    assert (got - want).abs().max().item() <= TOL * want.abs().max().item()


def test_pressure_callback_is_asked_for_the_shortfall(models):
    runner = BatchRunner(models("llama"), page_size=4, num_pages=4)
    held = runner.pool.reserve(3)  # e.g. the prefix cache's evictable pages
    asked = []

    def release(n):
        asked.append(n)
        for p in held[:n]:
            runner.pool.decref(p)
        del held[:n]
        return n

    runner.pool.on_pressure = release
    runner.begin(1)
    runner.step([(1, list(range(12)))])  # 3 pages, 1 free
    assert asked == [2] and runner.pool.free_count() == 0
    runner.pool.on_pressure = lambda n: 0
    with pytest.raises(OutOfPages):
        runner.pool.alloc()


def test_moe_experts_run_once_per_pass_for_all_tokens(models, one_torch_thread):
    """A step's prompt tokens share one expert call per layer (the MoE block's), and so do its
    decoding rows (the decode step's own MoE pass, kept apart from the prompt chunks for batch
    invariance: PagedRunner._mixed_step)."""
    from ktransformers.generation.decode_step import decode_step_for

    model = models("qwen3_moe")
    calls, lean_calls = [], []
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert experts and all(hasattr(e, "submit") for e in experts), "CPU experts injected"
    originals = [e.submit for e in experts]
    for e, orig in zip(experts, originals):
        e.submit = lambda x, *a, _orig=orig, **k: (calls.append(x.shape[0]), _orig(x, *a, **k))[1]
    step = decode_step_for(model)
    moes = [lay.moe for lay in step.layers]
    assert all(m is not None for m in moes), "the decode step runs these MoE blocks itself"
    for m in moes:
        m._submit = lambda pool, n, *a, _orig=m._submit: (lean_calls.append(n), _orig(pool, n, *a))[1]
    try:
        runner = BatchRunner(model, page_size=4, num_pages=16)
        for s in (1, 2, 3):
            runner.begin(s)
        runner.step([(1, [5]), (2, list(range(9))), (3, [7, 8])])
    finally:
        for e in experts:
            del e.submit
        for m in moes:
            del m._submit
    n = len(experts)
    assert lean_calls == [1] * n  # the decoding row's pass
    assert calls == [11] * n  # the prompt chunks' pass


def test_linear_attention_model_is_refused_by_name(models):
    with pytest.raises(ValueError, match="linear-attention"):
        BatchRunner(models("qwen3_5_moe_text"), page_size=4, num_pages=4)
    with pytest.raises(ValueError, match="self_attn: GptOssAttention has attention sinks"):
        BatchRunner(models("gpt_oss"), page_size=4, num_pages=4)


def test_bad_chunks_are_named(models):
    runner = BatchRunner(models("llama"), page_size=4, num_pages=8)
    runner.begin(1)
    with pytest.raises(KeyError, match="9"):
        runner.step([(9, [1])])
    with pytest.raises(ValueError, match="twice"):
        runner.step([(1, [1]), (1, [2])])
    with pytest.raises(ValueError, match="at least one token"):
        runner.step([(1, [])])
    with pytest.raises(ValueError, match="vocabulary"):
        runner.step([(1, [100000])])
    with pytest.raises(ValueError, match="multiple of page_size"):
        runner.begin(2, [0], 3)
    with pytest.raises(ValueError, match="already exists"):
        runner.begin(1)
    assert runner.seq_len(1) == 0 and runner.pool.free_count() == 8
    assert runner.step([]).shape == (0, runner.vocab_size)
    runner.release(1)
    with pytest.raises(KeyError):
        runner.release(1)
    with pytest.raises(ValueError, match="already free"):
        runner.pool.decref(0)


def test_decode_buckets_bound_the_padding():
    from ktransformers.generation.paged import PAD_WASTE, _length_buckets

    def lengths(pasts):
        return [[d[1] + 1 for d in b] for b in _length_buckets([(i, p, None) for i, p in enumerate(pasts)])]

    assert lengths([99] * 8) == [[100] * 8]
    assert lengths([4095, 1023, 255, 63]) == [[4096], [1024], [256], [64]]
    mixed = lengths([10, 500, 11, 490, 12, 480])
    assert sorted(sum(mixed, [])) == sorted([11, 501, 12, 491, 13, 481])
    assert all(len(b) * max(b) <= PAD_WASTE * sum(b) for b in mixed) and len(mixed) == 2


def test_window_layers_read_only_the_window():
    """A sliding-window layer gathers each sequence's last ``window`` keys (decode) and a chunk's
    keys from its first query's window on, with the same keep-set as the full masks."""
    from types import SimpleNamespace

    from ktransformers.generation.paged import _PagedBatch

    cpu = torch.device("cpu")
    # two decode tokens (past 17 and 5: one bucket) and a 4-token chunk after 8 past tokens
    batch = _PagedBatch(SimpleNamespace(page_size=4), [([0, 1, 2, 3, 4], 17, 1), ([5, 6], 5, 1), ([7, 8, 9], 8, 4)])
    assert len(batch.decode) == 1
    rows, mask = batch._decode_keys(0, cpu, cpu, window=6)
    assert rows.tolist() == [list(range(12, 18)), list(range(20, 26))] and mask is None
    rows, mask = batch._decode_keys(0, cpu, cpu, window=8)  # the short sequence pads, masked
    assert rows.shape == (2, 8) and rows[0].tolist() == list(range(10, 18))
    assert mask[:, 0, 0].tolist() == [[True] * 8, [True] * 6 + [False] * 2]
    full_read, _ = batch._decode_keys(0, cpu, cpu, window=None)
    assert full_read.shape == (2, 18)  # no window: every key up to the longest

    s, t, past, slots = batch.chunks[0]
    lo = past + 1 - 6
    trimmed = batch._chunk_mask(0, t, past, cpu, 6, lo)
    qpos, kpos = torch.arange(past, past + t)[:, None], torch.arange(past + t)[None, :]
    full = (kpos <= qpos) & (kpos > qpos - 6)
    assert not full[:, :lo].any() and torch.equal(trimmed, full[:, lo:])


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3_text"])
def test_unmodified_transformers_model_batches_too(arch, tiny_model_dir, one_torch_thread):
    """No injection needed for softmax attention: the plain transformers model, same check."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32).eval()
    prompts = [_prompt(n, seed=10 + i) for i, n in enumerate([7, 15, 22])]
    got = _drive(BatchRunner(model, page_size=8, num_pages=32), prompts, starts=[0, 1, 1], new=8, chunk=5)
    for i, p in enumerate(prompts):
        want_toks, want_logits = _alone(model, p, 8)
        assert got[i][0] == want_toks
        assert (got[i][1] - want_logits).abs().max().item() <= TOL * want_logits.abs().max().item()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_bf16_pages(arch, tiny_model_dir, one_torch_thread):
    """bf16 model: the pages are bf16; logits within the bf16 parity tolerance of the single path."""
    d = tiny_model_dir(arch)
    model = load_model(d, model_path=d, dtype=torch.bfloat16)
    runner = BatchRunner(model, page_size=4, num_pages=32)
    assert {t.dtype for t in runner.pool.tensors.values()} == {torch.bfloat16}
    prompts = [_prompt(n, seed=20 + i) for i, n in enumerate([6, 13])]
    got = _drive(runner, prompts, starts=[0, 1], new=6, chunk=4)
    for i, p in enumerate(prompts):
        _, want_logits = _alone(model, p, 6)
        n = len(got[i][0])
        assert (got[i][1] - want_logits[:n]).abs().max().item() <= 2e-2 * want_logits.abs().max().item()


def test_batched_absorbed_decode_equals_per_row_attention():
    from ktransformers.operators.mla import absorbed_attention, absorbed_decode_attention, build_chunk_mask

    g = torch.Generator().manual_seed(0)
    N, H, nope, rope, C, v, L = 3, 4, 16, 8, 32, 16, 11
    r = lambda *s: torch.randn(*s, generator=g)
    qn, qp, c, k, w_uk, w_uv = r(N, H, 1, nope), r(N, H, 1, rope), r(N, 1, L, C), r(N, 1, L, rope), r(H, nope, C), r(H, v, C)
    lengths = [11, 4, 7]
    mask = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    got = absorbed_decode_attention(qn, qp, c, k, w_uk, w_uv, 0.3, mask)
    for i, n in enumerate(lengths):
        want = absorbed_attention(qn[i : i + 1], qp[i : i + 1], c[i : i + 1, :, :n], k[i : i + 1, :, :n], w_uk, w_uv,
                                  0.3, build_chunk_mask(None, 0, 1, n, 1, n))
        assert torch.allclose(got[i : i + 1], want, atol=1e-5)
