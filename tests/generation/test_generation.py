"""The generation engine: parity with transformers' generate(), sampling, stops, text."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from ktransformers.generation import (
    GenerationStats, Generator, IncrementalDetokenizer, SamplingParams, StopStrings, TokenEvent,
)
from ktransformers.util.tiny_models import make_tiny_tokenizer, tiny_config

ARCHS = ["qwen3_moe", "gemma3_text", "deepseek_v3"]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    """``loaded(arch)`` → (injected model, tokenizer), loaded once per arch."""
    from transformers import AutoTokenizer

    from ktransformers import load_model

    cache = {}

    def get(arch):
        if arch not in cache:
            d = tiny_model_dir(arch)
            cache[arch] = (load_model(d, d), AutoTokenizer.from_pretrained(d, local_files_only=True))
        return cache[arch]

    return get


# --------------------------------------------------------------- a model that says what we want


class ScriptedLM(nn.Module):
    """Emits ``script[k]`` as the argmax at generation step k (k counts forwards since position 0)."""

    def __init__(self, script: list[int], vocab: int = 320):
        super().__init__()
        self.config = tiny_config("llama")
        self.script = list(script)
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, 1)
        self.generation_config = None
        self.step = 0
        self.calls = []

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, cache=None, position_ids=None, use_cache=True, logits_to_keep=0):
        self.calls.append(input_ids.shape[1])
        if int(position_ids[0, 0]) == 0:
            self.step = 0
        tok = self.script[min(self.step, len(self.script) - 1)]
        self.step += 1
        logits = torch.full((1, input_ids.shape[1], self.vocab), -10.0)
        logits[0, -1, tok] = 10.0
        return type("Out", (), {"logits": logits})()


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def scripted(tok, text: str, *, eos: bool = False) -> Generator:
    ids = tok.encode(text, add_special_tokens=False)
    if eos:
        ids.append(tok.eos_token_id)
    model = ScriptedLM(ids + [tok.encode("~", add_special_tokens=False)[0]] * 64)
    return Generator(model, tok)


PROMPT = [tid for tid in range(40, 52)]


def collect(events):
    events = list(events)
    assert events[-1].token_id is None and events[-1].finish_reason is not None
    assert all(e.finish_reason is None for e in events[:-1])
    return events


# ------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_stream_equals_transformers_generate(loaded, arch):
    model, tok = loaded(arch)
    gen = Generator(model, tok, chunk_size=5)
    gen.eos_ids = set()  # compare a fixed number of tokens
    ids = gen.apply_chat_template([{"role": "user", "content": "Hello there, how are you today?"}])
    events = collect(gen.stream(ids, SamplingParams(max_new_tokens=24)))
    ours = [e.token_id for e in events[:-1]]
    ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(ids):].tolist()
    assert ours == ref
    assert events[-1].finish_reason == "length"
    st = gen.last_stats
    assert st.prompt_tokens == len(ids) and st.generated_tokens == 24
    assert st.prefill_seconds > 0 and st.decode_seconds > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_one_shot(loaded, arch):
    model, tok = loaded(arch)
    ids = list(range(3, 40))  # longer than gemma3_text's sliding window (8)
    one = Generator(model, tok, chunk_size=4096)
    chunked = Generator(model, tok, chunk_size=3)
    a = one.prefill(ids, one.new_cache(64))
    b = chunked.prefill(ids, chunked.new_cache(64))
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([ids])).logits[:, -1].float()
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, full, atol=1e-5, rtol=1e-5)


def test_prefill_runs_in_chunks(tok):
    gen = scripted(tok, "abc")
    gen.chunk_size = 5
    list(gen.stream(list(range(40, 52)), SamplingParams(max_new_tokens=2)))
    assert gen.model.calls == [5, 5, 2, 1]


# ----------------------------------------------------------------------------- stopping


def test_max_new_tokens_finishes_with_length(tok):
    gen = scripted(tok, "abcdefghij")
    text, ids, finish = gen.generate(PROMPT, SamplingParams(max_new_tokens=4))
    assert (text, finish, len(ids)) == ("abcd", "length", 4)
    assert gen.last_stats.generated_tokens == 4


def test_eos_stops_and_is_not_printed(tok):
    gen = scripted(tok, "hi!", eos=True)
    text, ids, finish = gen.generate(PROMPT, SamplingParams(max_new_tokens=50))
    assert (text, finish) == ("hi!", "stop")
    assert tok.eos_token_id not in ids


def test_every_generation_config_eos_id_stops(tok):
    gen = scripted(tok, "abcdef")
    gen.eos_ids = {tok.encode("d", add_special_tokens=False)[0], 999}
    assert gen.generate(PROMPT, SamplingParams(max_new_tokens=50))[::2] == ("abc", "stop")


def test_stop_string_cuts_output(tok):
    gen = scripted(tok, "The answer is 42. END of story")
    events = collect(gen.stream(PROMPT, SamplingParams(max_new_tokens=60, stop=["END", "zzz"])))
    text = "".join(e.text for e in events)
    assert text == "The answer is 42. " and events[-1].finish_reason == "stop"
    assert not any("E" in e.text for e in events)  # never emitted, then taken back


def test_stop_string_prefix_is_released_when_it_does_not_complete(tok):
    gen = scripted(tok, "a-b a-c done")
    text, _, finish = gen.generate(PROMPT, SamplingParams(max_new_tokens=12, stop=["a-c!"]))
    assert (text, finish) == ("a-b a-c done", "length")


def test_stop_strings_unit():
    s = StopStrings(["</answer>"])
    assert s.feed("x </ans") == ("x ", False)
    assert s.feed("wer> tail") == ("", True)
    s = StopStrings(["ab"])
    assert s.feed("xa") == ("x", False)
    assert s.feed("c") == ("ac", False)
    assert s.flush() == ""


def test_cancel_stops_within_one_token(tok):
    gen = scripted(tok, "abcdefghijklmnop")
    cancel = threading.Event()
    got = []
    for ev in gen.stream(PROMPT, SamplingParams(max_new_tokens=100), cancel):
        got.append(ev)
        if len(got) == 3:
            cancel.set()
    assert [e.text for e in got] == ["a", "b", "c", ""]
    assert got[-1].finish_reason == "cancelled"


def test_cancel_before_start(tok):
    gen = scripted(tok, "abc")
    cancel = threading.Event()
    cancel.set()
    assert gen.generate(PROMPT, SamplingParams(max_new_tokens=10), cancel) == ("", [], "cancelled")


def test_zero_new_tokens_and_empty_prompt(tok):
    gen = scripted(tok, "abc")
    assert gen.generate(PROMPT, SamplingParams(max_new_tokens=0)) == ("", [], "length")
    from ktransformers.errors import ConfigError

    with pytest.raises(ConfigError):
        gen.generate([], SamplingParams())


def test_max_cache_len_caps_new_tokens(tok):
    gen = scripted(tok, "abcdefghij")
    gen.max_cache_len = len(PROMPT) + 3
    assert gen.generate(PROMPT, SamplingParams(max_new_tokens=50))[::2] == ("abc", "length")


# ---------------------------------------------------------------------------------- text


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "ok 🙂 done", "€uro"])
def test_multibyte_characters_split_over_tokens(tok, text):
    gen = scripted(tok, text)
    n = len(tok.encode(text, add_special_tokens=False))
    assert n > len(text)  # the byte-level tokenizer really splits characters
    events = collect(gen.stream(PROMPT, SamplingParams(max_new_tokens=n)))
    assert "".join(e.text for e in events) == text
    assert not any("\ufffd" in e.text for e in events)
    assert any(e.text == "" for e in events[:-1])  # held back mid-character


def test_incomplete_character_at_the_end_is_flushed(tok):
    ids = tok.encode("a€", add_special_tokens=False)[:-1]  # cut the euro sign short
    d = IncrementalDetokenizer(tok, PROMPT)
    out = [d.add(i) for i in ids]
    assert out[0] == "a" and out[1:] == [""] * (len(ids) - 1)
    assert d.flush() == tok.decode(ids)[1:]


def test_leading_space_of_first_token_kept(tok):
    d = IncrementalDetokenizer(tok, tok.encode("The capital", add_special_tokens=False))
    assert "".join(d.add(i) for i in tok.encode(" is Paris", add_special_tokens=False)) == " is Paris"


# ------------------------------------------------------------------------------ sampling


def test_seeded_sampling_is_reproducible(loaded):
    model, tok = loaded("qwen3_moe")
    gen = Generator(model, tok)
    gen.eos_ids = set()
    ids = tok.encode("Once upon a time")
    p = dict(temperature=1.0, top_k=50, top_p=0.95, max_new_tokens=16)
    a = gen.generate(ids, SamplingParams(seed=1234, **p))[1]
    b = gen.generate(ids, SamplingParams(seed=1234, **p))[1]
    c = gen.generate(ids, SamplingParams(seed=99, **p))[1]
    assert a == b and len(a) == 16
    assert a != c
    greedy = gen.generate(ids, SamplingParams(max_new_tokens=16))[1]
    assert gen.generate(ids, SamplingParams(temperature=1.0, top_k=1, seed=5, max_new_tokens=16))[1] == greedy


def test_repetition_penalty_changes_greedy_choice(tok):
    # a penalty on an already-seen token's positive logit can flip the argmax to the runner-up
    from ktransformers.generation import Sampler

    logits = torch.tensor([[0.0, 5.0, 4.0, 0.0]])
    seen = torch.tensor([[1]])
    assert Sampler(SamplingParams(), torch.device("cpu"))(logits.clone(), seen) == 1
    assert Sampler(SamplingParams(repetition_penalty=1.5), torch.device("cpu"))(logits.clone(), seen) == 2


def test_top_k_restricts_support():
    from ktransformers.generation import Sampler

    logits = torch.tensor([[3.0, 2.9, 2.8, -50.0, 2.7]])
    got = {Sampler(SamplingParams(temperature=5.0, top_k=2, seed=s), torch.device("cpu"))(logits.clone(), None)
           for s in range(40)}
    assert got == {0, 1}


def test_bad_sampling_params_are_one_line_errors():
    from ktransformers.errors import ConfigError

    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(repetition_penalty=0)):
        with pytest.raises(ConfigError):
            SamplingParams(**bad).validate()


# --------------------------------------------------------------------------- chat prompts


def test_chat_template_and_plain_fallback(loaded):
    model, tok = loaded("qwen3_moe")
    gen = Generator(model, tok)
    msgs = [{"role": "user", "content": "hi"}]
    ids = gen.apply_chat_template(msgs)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id in gen.eos_ids
    base = make_tiny_tokenizer()
    base.chat_template = None
    plain = Generator(model, base)
    ids = plain.apply_chat_template([{"role": "user", "content": "The sky is"},
                                     {"role": "assistant", "content": " blue."},
                                     {"role": "user", "content": [{"type": "text", "text": "Grass is"}]}])
    assert base.decode(ids) == "The sky is blue.\nGrass is"


def test_stats_line():
    st = GenerationStats(prompt_tokens=10, prefill_seconds=0.5, generated_tokens=11, decode_seconds=2.0)
    assert st.prefill_tps == 20.0 and st.decode_tps == 5.0
    line = st.line()
    assert "prompt eval count: 10 token(s)" in line and "rate: 20.00 tokens/s" in line
    assert "eval count: 11 token(s)" in line and "rate: 5.00 tokens/s" in line
    assert "\n" not in line


def test_token_event_defaults():
    assert TokenEvent(5, "x").finish_reason is None
