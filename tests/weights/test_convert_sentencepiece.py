"""A SentencePiece tokenizer.model goes into the GGUF as llama.cpp's ``llama`` vocabulary: gguf-py reads
the fields, and this project's GGUF tokenizer gives the HF tokenizer's ids."""

from __future__ import annotations

import json

import gguf
import pytest

from ktransformers.convert import convert
from ktransformers.weights.gguf_source import GGUFSource, field_value
from ktransformers.weights.gguf_vocab import (TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN,
                                              TOKEN_UNUSED, TOKEN_USER_DEFINED)

spm = pytest.importorskip("sentencepiece")

LINES = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a tiny SentencePiece model.",
         "Numbers 12345 and symbols #@! are here.", "Ünïcödé wörds and 日本語 text.",
         "A second line of plain text for training the merges."]
SAMPLES = ["Hello world", "The lazy fox, 12345!", "日本語 and ünïcödé", "zebra quartz \u00e9t\u00e9 \U0001f600",
           "Hello<sep>world", "line one\nline two"]


def _train(folder, vocab_size=400):
    folder.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(LINES * 20), model_prefix=str(folder / "sp"),
                                   vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
                                   character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   minloglevel=2, hard_vocab_limit=False)
    (folder / "sp.model").rename(folder / "tokenizer.model")
    (folder / "sp.vocab").unlink()


def _model_dir(tmp_path, arch, vocab_size):
    """A tiny model whose folder has a SentencePiece tokenizer.model (no tokenizer.json) and one
    added special token past the SentencePiece vocabulary."""
    from ktransformers.util.tiny_models import write_tiny_model

    d = tmp_path / arch
    write_tiny_model(arch, d, seed=0, with_tokenizer=False, vocab_size=vocab_size)
    _train(d)
    cls = "GemmaTokenizer" if arch.startswith("gemma") else "LlamaTokenizer"
    cfg = {"tokenizer_class": cls, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
           "add_bos_token": True, "add_eos_token": False,
           "added_tokens_decoder": {"400": {"content": "<sep>", "special": True}}}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    c = json.loads((d / "config.json").read_text())
    c.update(bos_token_id=1, eos_token_id=2)
    (d / "config.json").write_text(json.dumps(c))
    return d


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_sentencepiece_vocab_round_trips(tmp_path, arch):
    from transformers import AutoTokenizer

    d = _model_dir(tmp_path, arch, vocab_size=404)
    out = convert(d, tmp_path / "m.gguf", preset="Q8_0")
    r = gguf.GGUFReader(str(out))  # llama.cpp's own reader
    f = {k: field_value(v) for k, v in r.fields.items() if k.startswith("tokenizer.")}
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.pre"] == "default"
    assert len(f["tokenizer.ggml.tokens"]) == len(f["tokenizer.ggml.scores"]) == 404
    assert f["tokenizer.ggml.tokens"][:400] == [sp.IdToPiece(i) for i in range(400)]
    assert f["tokenizer.ggml.scores"][10] == pytest.approx(sp.GetScore(10))
    assert r.fields["tokenizer.ggml.scores"].types[-1] == gguf.GGUFValueType.FLOAT32
    assert r.fields["tokenizer.ggml.token_type"].types[-1] == gguf.GGUFValueType.INT32
    tt = f["tokenizer.ggml.token_type"]
    assert tt[0] == TOKEN_UNKNOWN and tt[1] == tt[2] == TOKEN_CONTROL
    assert all(tt[i] == TOKEN_BYTE for i in range(400) if sp.IsByte(i)) and TOKEN_NORMAL in tt
    assert f["tokenizer.ggml.tokens"][400] == "<sep>" and tt[400] == TOKEN_CONTROL
    assert f["tokenizer.ggml.tokens"][403] == "[PAD403]" and tt[403] == TOKEN_UNUSED
    assert f["tokenizer.ggml.scores"][403] == -10000.0 and f["tokenizer.ggml.scores"][400] == -1000.0
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"], f["tokenizer.ggml.unknown_token_id"]) \
        == (1, 2, 0)
    assert f["tokenizer.ggml.add_bos_token"] is True and f["tokenizer.ggml.add_eos_token"] is False
    assert ("tokenizer.ggml.add_space_prefix" in f) == arch.startswith("gemma")
    assert TOKEN_USER_DEFINED not in tt

    tok, ref = GGUFSource(out).tokenizer(), AutoTokenizer.from_pretrained(d)
    for s in SAMPLES:
        assert tok.encode(s) == ref.encode(s), s
        assert tok.encode(s, add_special_tokens=False) == ref.encode(s, add_special_tokens=False), s
    assert tok.decode(ref.encode(SAMPLES[2]), skip_special_tokens=True) == SAMPLES[2]


def test_bad_sentencepiece_model_is_one_line(tmp_path):
    from ktransformers.errors import ConfigError

    d = _model_dir(tmp_path, "llama", vocab_size=404)
    (d / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="tokenizer.model: not a SentencePiece model"):
        convert(d, tmp_path / "m.gguf", preset="Q8_0")
