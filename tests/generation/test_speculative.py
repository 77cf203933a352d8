"""Speculative decoding (generation/speculative.py): guesses verified as rows of one decode step.

What must hold: the verify step's row r has the bits of a plain step after the rows before it
(so greedy answers are the plain ones token for token), undoing rejected rows leaves the cache as
plain steps would (sliding windows that rolled included), and with sampling each emitted token has
the request's distribution (a chi-square test on the accept / reject rule).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ktransformers.errors import ConfigError
from ktransformers.generation import Generator, SamplingParams
from ktransformers.generation.decode_step import decode_step_for
from ktransformers.generation.sampling import Sampler
from ktransformers.generation.speculative import NgramDrafter, Policy

from .test_invariance import _NoText


# a sliding window shorter than the prompt: the verify rows roll the window, and undo restores it;
# DeepSeek MLA (V2: no q_lora, complex RoPE, softmax router; V3: q_lora, interleaved RoPE, sigmoid
# grouped router) keeps its own head sizes (head_dim is its rope width there); GLM-4-MoE rotates half
# of each head (32 of 64: the cos / sin of several rows in one call) with q/k norms and biases
H64 = {"head_dim": 64}
FAMILIES = [("llama", H64), ("qwen3_moe", H64), ("qwen2_moe", {**H64, "shared_expert_intermediate_size": 64}),
            ("gemma3_text", {**H64, "sliding_window": 8}), ("deepseek_v2", {}), ("deepseek_v3", {}),
            ("glm4_moe", H64)]


@pytest.mark.parametrize("arch,extra", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_verify_rows_are_plain_steps_and_undo_restores_the_cache(tiny, arch, extra):
    model = tiny(arch, **extra)
    step = decode_step_for(model)
    assert step is not None
    rng = np.random.default_rng(7)
    prompt = [int(i) for i in rng.integers(3, 250, 12)]
    toks = [int(i) for i in rng.integers(3, 250, 6)]
    g = Generator(model, _NoText())
    n = len(prompt)
    with torch.inference_mode():
        plain = g.new_cache(40)
        g.prefill(prompt, plain)
        want = [step.step(t, n + i, plain)[0].clone() for i, t in enumerate(toks)]

        cache = g.new_cache(40)
        g.prefill(prompt, cache)
        logits, undo = step.step_rows(toks, n, cache)
        for i in range(len(toks)):
            assert torch.equal(logits[i], want[i]), f"{arch}: verify row {i} differs from the plain step"
        undo(2)  # keep two rows, then step the rest plainly: the same bits as never having guessed
        for i, t in enumerate(toks[2:]):
            assert torch.equal(step.step(t, n + 2 + i, cache)[0], want[2 + i]), f"{arch}: step {2 + i} after undo"

        cache = g.new_cache(40)
        g.prefill(prompt, cache)
        _, undo = step.step_rows([9, 9, 9, 9, 9], n, cache)
        undo(0)  # every row rejected
        logits, _ = step.step_rows(toks, n, cache)
        for i in range(len(toks)):
            assert torch.equal(logits[i], want[i]), f"{arch}: row {i} after undoing a whole verify"


def _copy_prompt(rng, vocab=250, n=24, repeats=3):
    """A prompt that repeats a random run: a model that continues it gives lookup matches."""
    run = [int(i) for i in rng.integers(3, vocab, n)]
    return run * repeats + run[: n // 2]


class _OracleDrafter:
    """Guesses from the known plain answer, every third guess wrong: verifies that accept some rows
    and reject others at every depth, whatever the model copies."""

    def __init__(self, prompt, answer):
        self.n, self.answer, self.tokens = len(prompt), answer, []

    def extend(self, tokens):
        self.tokens.extend(tokens)

    def append(self, token):
        self.tokens.append(token)

    def draft(self, k):
        at = len(self.tokens) - self.n
        out = list(self.answer[at:at + k])
        for i in range(len(out)):
            if (at + i) % 3 == 2:
                out[i] = (out[i] + 1) % 250 + 3
        return out


@pytest.mark.parametrize("arch,extra", FAMILIES, ids=[f[0] for f in FAMILIES])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_speculative_greedy_is_the_plain_answer(tiny, arch, extra, penalty, monkeypatch):
    check_speculative_greedy(tiny(arch, **extra), SamplingParams(max_new_tokens=40, repetition_penalty=penalty),
                             monkeypatch)


def check_speculative_greedy(model, params, monkeypatch) -> None:
    """Greedy with prompt lookup's own guesses, then with guesses right and wrong at every depth,
    gives the plain answer token for token (some guesses kept, some not)."""
    import ktransformers.generation.speculative as spec

    prompt = _copy_prompt(np.random.default_rng(3))
    _, want, _ = Generator(model, _NoText()).generate(prompt, params)
    g = Generator(model, _NoText(), speculative="ngram", draft_max=6)
    _, got, _ = g.generate(prompt, params)
    assert got == want  # prompt lookup's own guesses
    monkeypatch.setattr(spec, "make_drafter", lambda *a: _OracleDrafter(prompt, want))
    _, got, _ = g.generate(prompt, params)
    assert got == want  # guesses right and wrong at every depth
    st = g.last_stats
    assert 0 < st.accepted_tokens < st.drafted_tokens
    assert st.generated_tokens - len(want) in (0, 1)  # (+ an end-of-text token the answer leaves out)


def test_acceptance_on_a_model_that_copies(tiny):
    """Greedy on a prompt that the tiny model continues by repeating its own output: guesses are
    accepted, and the answer is still the plain one."""
    model = tiny("llama", head_dim=64)
    rng = np.random.default_rng(11)
    prompt = [int(i) for i in rng.integers(3, 250, 16)]
    params = SamplingParams(max_new_tokens=120)
    _, want, _ = Generator(model, _NoText()).generate(prompt, params)
    g = Generator(model, _NoText(), speculative="ngram")
    _, got, _ = g.generate(prompt, params)
    assert got == want
    if len(set(want[-40:])) < 40:  # the greedy answer cycles (random tiny models mostly do)
        assert g.last_stats.accepted_tokens > 0


def test_verify_sampling_keeps_the_distribution():
    """The accept / reject rule for a guessed token: the emitted token's histogram over many draws
    matches p (chi-square, p-value > 1e-3 with fixed seeds), for a likely and an unlikely guess."""
    torch.manual_seed(0)
    V = 12
    logits = torch.randn(1, V) * 1.5
    params = SamplingParams(temperature=0.8, top_k=8, seed=1234)
    s = Sampler(params, torch.device("cpu"))
    # p: the processed distribution (temperature, top-k) the plain sampler draws from
    warped = logits.clone()
    for proc in s.processors:
        warped = proc(None, warped)
    p = torch.softmax(warped, -1).reshape(-1).double()
    order = p.argsort(descending=True)
    for guess in (int(order[0]), int(order[5])):
        draws = 20000
        counts = np.zeros(V)
        for _ in range(draws):
            counts[s.verify(logits.clone(), None, guess)] += 1
        keep = p.numpy() > 0
        assert counts[~keep].sum() == 0  # never a token the warpers removed
        expected = p.numpy()[keep] * draws
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        dof = int(keep.sum()) - 1
        pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                               torch.tensor(chi2 / 2, dtype=torch.float64)))
        assert pvalue > 1e-3, f"guess {guess}: emitted histogram differs from p (chi2 {chi2:.1f}, p-value {pvalue:.2g})"


def test_speculative_sampling_runs_and_guesses(tiny, monkeypatch):
    import ktransformers.generation.speculative as spec

    model = tiny("llama", head_dim=64)
    prompt = _copy_prompt(np.random.default_rng(5))
    _, greedy, _ = Generator(model, _NoText()).generate(prompt, SamplingParams(max_new_tokens=30))
    monkeypatch.setattr(spec, "make_drafter", lambda *a: _OracleDrafter(prompt, greedy))
    g = Generator(model, _NoText(), speculative="ngram")
    _, got, finish = g.generate(prompt, SamplingParams(max_new_tokens=30, temperature=0.7, seed=3))
    assert len(got) == 30 and finish == "length"
    assert g.last_stats.drafted_tokens > 0


@pytest.mark.parametrize("arch,extra", [("llama", {}), ("gemma3_text", {"sliding_window": 8})], ids=["llama", "gemma3"])
def test_a_draft_model_that_is_the_model_guesses_everything(tiny, arch, extra, tmp_path):
    """The model as its own draft (a second copy): every guess is the model's own token, so all are
    kept -- the draft's cache follows the text, undo included (its window rolls on gemma3)."""
    from ktransformers import load_model
    from ktransformers.util.tiny_models import write_tiny_model

    model = tiny(arch, head_dim=64, **extra)
    write_tiny_model(arch, tmp_path, seed=2, head_dim=64, **extra)
    twin = load_model(tmp_path, model_path=tmp_path)
    prompt = _copy_prompt(np.random.default_rng(3))
    params = SamplingParams(max_new_tokens=40)
    _, want, _ = Generator(model, _NoText()).generate(prompt, params)
    g = Generator(model, _NoText(), speculative="draft", draft_model=twin, draft_max=5)
    _, got, _ = g.generate(prompt, params)
    assert got == want
    st = g.last_stats
    assert st.drafted_tokens > 20 and st.accepted_tokens == st.drafted_tokens


def test_a_different_draft_model_keeps_the_answer(tiny, tmp_path):
    from ktransformers import load_model
    from ktransformers.util.tiny_models import write_tiny_model

    model = tiny("qwen3_moe", head_dim=64)
    write_tiny_model("llama", tmp_path, seed=9, head_dim=64, vocab_size=model.config.vocab_size)
    other = load_model(tmp_path, model_path=tmp_path)
    prompt = _copy_prompt(np.random.default_rng(4))
    for params in (SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=30, repetition_penalty=1.2)):
        _, want, _ = Generator(model, _NoText()).generate(prompt, params)
        g = Generator(model, _NoText(), speculative="draft", draft_model=other, draft_max=4)
        _, got, _ = g.generate(prompt, params)
        assert got == want and g.last_stats.drafted_tokens > 0


def test_a_draft_model_of_another_vocabulary_is_refused(tiny, tmp_path):
    from ktransformers import load_model
    from ktransformers.util.tiny_models import write_tiny_model

    model = tiny("llama", head_dim=64)
    write_tiny_model("llama", tmp_path, seed=9, head_dim=64, vocab_size=model.config.vocab_size + 64)
    other = load_model(tmp_path, model_path=tmp_path)
    with pytest.raises(ConfigError, match="draft model: vocabulary of"):
        Generator(model, _NoText(), speculative="draft", draft_model=other)
    with pytest.raises(ConfigError, match="needs a draft_model"):
        Generator(model, _NoText(), speculative="draft")


def test_ngram_drafter_takes_the_latest_longest_match():
    d = NgramDrafter(ngram_min=2, ngram_max=3)
    d.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # suffix (1, 2, 3) occurred at the start, followed by 4 5 9
    assert d.draft(3) == [4, 5, 9]
    d.extend([6, 2, 3])
    # no earlier (6, 2, 3); (2, 3)'s latest earlier occurrence continued with 6
    assert d.draft(2) == [6, 2]
    assert NgramDrafter().draft(4) == []


def test_policy_backs_off_after_misses_and_grows_on_hits():
    pol = Policy(8)
    assert pol.next_k() == 4
    pol.update(4, 4)
    assert pol.next_k() == 8
    pol.update(8, 0)  # a miss: one token's pause, then a single guess
    assert pol.next_k() == 0 and pol.next_k() == 1
    pol.update(1, 0)  # a second miss in a row: two tokens' pause
    assert [pol.next_k() for _ in range(3)] == [0, 0, 1]
    pol.update(1, 1)
    assert pol.next_k() == 2


def test_bad_drafter_settings_are_one_line_errors(tiny):
    model = tiny("llama", head_dim=64)
    with pytest.raises(ConfigError, match="unknown drafter"):
        Generator(model, _NoText(), speculative="mtp-please")
    with pytest.raises(ConfigError, match="--draft_max"):
        Generator(model, _NoText(), speculative="ngram", draft_max=0)


def test_a_model_without_the_step_decodes_plainly(tiny, monkeypatch):
    """Where the decode step cannot verify rows (here: switched off), speculation is skipped and the
    answer is the plain one."""
    model = tiny("llama", head_dim=64)
    prompt = _copy_prompt(np.random.default_rng(3))
    params = SamplingParams(max_new_tokens=20)
    monkeypatch.setenv("KT_LEAN_DECODE", "0")
    _, want, _ = Generator(model, _NoText()).generate(prompt, params)
    g = Generator(model, _NoText(), speculative="ngram")
    _, got, _ = g.generate(prompt, params)
    assert got == want and g.last_stats.drafted_tokens == 0


def test_local_chat_flags(tmp_path):
    from ktransformers.local_chat import _check_args, build_parser

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    args = build_parser().parse_args(["--gguf_path", str(model), "--speculative", "ngram", "--draft_max", "12"])
    assert args.speculative == "ngram" and args.draft_max == 12
    _check_args(args)
    with pytest.raises(ConfigError, match="--draft_max must be between 1 and 32"):
        _check_args(build_parser().parse_args(["--gguf_path", str(model), "--draft_max", "0"]))


def test_local_chat_with_a_draft_model_gives_the_plain_answer(tiny_model_dir):
    from tests.test_local_chat import run_chat

    d = tiny_model_dir("llama")
    common = ("--model_path", d, "--prompt", "Hello Hello Hello Hello", "--max_new_tokens", 24, "--stats",
              "--cpu_infer", 1, "--temperature", 0)
    plain = run_chat(*common)
    spec = run_chat(*common, "--speculative", f"draft:{d}", "--draft_max", 4)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "drafted " in spec.stderr and "draft model:" in spec.stderr, spec.stderr
    bad = run_chat("--model_path", d, "--prompt", "Hi", "--speculative", "draft:/nonexistent/model.gguf")
    assert bad.returncode == 2 and "--speculative draft:/nonexistent/model.gguf: no such file" in bad.stderr
    assert "Traceback" not in bad.stderr
    bad = run_chat("--model_path", d, "--prompt", "Hi", "--speculative", "eagle")
    assert bad.returncode == 2 and "choose ngram, mtp or draft:PATH" in bad.stderr
    bad = run_chat("--model_path", d, "--prompt", "Hi", "--speculative", "mtp")  # a llama has no MTP layer
    assert bad.returncode == 2 and "--speculative mtp: llama models have no MTP layer" in bad.stderr


def test_fuzz_speculative_values_are_a_drafter_or_one_line_errors(tmp_path):
    """Any ``--speculative`` / ``--draft_max`` value is a drafter (ngram, mtp, draft:an existing
    path) or one ``ConfigError`` line naming the flag; never another exception."""
    pytest.importorskip("hypothesis")
    from hypothesis import given
    from hypothesis import strategies as st

    from ktransformers.generation.speculative import parse_speculative
    from tests.fuzzing import fuzz_settings

    path = tmp_path / "draft.gguf"
    path.write_bytes(b"GGUF")
    values = st.one_of(st.none(), st.text(max_size=30), st.sampled_from(["ngram", "mtp", "draft:", f"draft:{path}"]),
                       st.text(max_size=12).map(lambda t: "draft:" + t), st.text(max_size=6).map(lambda t: "mtp" + t))

    @fuzz_settings(300, deadline=None, derandomize=True)
    @given(values, st.integers(-5, 40))
    def check(spec, draft_max):
        try:
            name, got = parse_speculative(spec, draft_max)
        except ConfigError as e:
            msg = str(e)
            assert "\n" not in msg and ("--speculative" in msg or "--draft_max" in msg), msg
            return
        assert 1 <= draft_max <= 32
        if spec is None:
            assert (name, got) == (None, None)
        elif spec in ("ngram", "mtp"):
            assert (name, got) == (spec, None)
        else:
            assert name == "draft" and spec == f"draft:{got}" and Path(got).exists()

    check()
