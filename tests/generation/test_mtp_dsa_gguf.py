"""The MTP block of DeepSeek-V3.2 (``deepseek32``) and GLM-5 (``glm-dsa``) GGUFs (generation/mtp.py;
the names: weights/gguf_names.py ``_NEXTN``).

Tiny ``deepseek_v32`` / ``glm_moe_dsa`` checkpoints with a random MTP layer after their three
decoder layers (``test_mtp.write_mtp_checkpoint``; the layer runs its own indexer), converted by
our converter at F32 with the block as llama.cpp's converter writes GLM-5's.  From that file:

* the block is there under llama.cpp's names (``blk.3.nextn.*`` beside the decoder layer's
  ``blk.3.*``, the indexer's included), ``block_count`` 4, ``nextn_predict_layers`` 1 and, for
  glm-dsa, the per-layer ``attention.indexer.types`` over the 4 blocks;
* the model has three layers: its logits are transformers' own model's on the checkpoint (the
  block is not read as a fourth decoder layer), and the MTP layer's tensors are the
  checkpoint's, bit for bit (as the layer read from the safetensors checkpoint itself);
* ``speculative="mtp"`` answers greedy prompts with the plain tokens and guesses nothing, because
  the decode step that verifies guesses does not serve the sparse-attention indexer: the layer is
  checked (the errors below) but none of its tensors is read, and one warning line says so
  (docs/speculative.md);
* a file with part of the block is refused with one line naming a missing tensor by its GGUF name
  (fuzzed over which part is missing), one without the block (llama.cpp's own tiny files too) with
  "no MTP layer".
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from ktransformers import load_model
from ktransformers.convert import convert
from ktransformers.errors import ConfigError, WeightError
from ktransformers.generation import Generator, SamplingParams
from ktransformers.generation.mtp import load_mtp_layer
from ktransformers.weights.gguf_source import GGUFSource
from ktransformers.weights.safetensors_source import SafetensorsSource

from .test_invariance import _NoText
from .test_mtp import _prompt, write_mtp_checkpoint
from .test_mtp_gguf import LLAMA_CPP_NEXTN, ROOT, _one_line, _refusal, _without, check_any_part_missing_is_named

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH = {"deepseek_v32": "deepseek32", "glm_moe_dsa": "glm-dsa"}


@pytest.fixture(scope="module", params=sorted(ARCH))
def dsa_family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def dsa_dir(dsa_family, tmp_path_factory) -> Path:
    return write_mtp_checkpoint(dsa_family, tmp_path_factory.mktemp(f"{dsa_family}-mtp"))


@pytest.fixture(scope="module")
def dsa_gguf(dsa_dir, tmp_path_factory) -> Path:
    return convert(dsa_dir, tmp_path_factory.mktemp("dsa-mtp-gguf") / "f32.gguf", "F32", "F32", "F32",
                   tokenizer=False)


@pytest.fixture(scope="module")
def dsa_model(dsa_gguf, dsa_dir):
    return load_model(dsa_gguf, model_path=dsa_dir)


def test_the_file_holds_the_block_as_llama_cpp_writes_it(dsa_gguf, dsa_family):
    r = gguf.GGUFReader(dsa_gguf)
    A = ARCH[dsa_family]
    assert r.fields[f"{A}.block_count"].contents() == 4 and r.fields[f"{A}.nextn_predict_layers"].contents() == 1
    names = {t.name for t in r.tensors}
    assert {n for n in names if ".nextn." in n} == LLAMA_CPP_NEXTN
    assert {"blk.3.attn_kv_a_mqa.weight", "blk.3.ffn_gate_exps.weight", "blk.3.indexer.attn_k.weight"} <= names
    if dsa_family == "glm_moe_dsa":  # the tiny's layers, then the MTP layer's own indexer
        assert r.fields[f"{A}.attention.indexer.types"].contents() == [True, True, False, True]
    cfg = GGUFSource(dsa_gguf).config()
    assert cfg.num_hidden_layers == 3 and len(getattr(cfg, "indexer_types", None) or [0] * 3) == 3


def test_the_model_is_the_checkpoints_and_the_mtp_layer_is_read(dsa_gguf, dsa_dir, dsa_model):
    from transformers import AutoModelForCausalLM

    assert len(dsa_model.model.layers) == 3
    hf = AutoModelForCausalLM.from_pretrained(dsa_dir, dtype=torch.float32).eval()
    ids = torch.tensor([_prompt()[:24]])
    with torch.no_grad():
        want, got = hf(ids).logits, dsa_model(ids).logits
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, err  # a fourth layer (the MTP block read as one) would be far off
    st, gg = SafetensorsSource(dsa_dir / "model.safetensors"), GGUFSource(dsa_gguf)
    names = [n for n in st.names() if n.startswith("model.layers.3.") and "embed_tokens" not in n
             and "shared_head.head" not in n]
    assert "model.layers.3.eh_proj.weight" in names and "model.layers.3.self_attn.indexer.wk.weight" in names
    for n in names:
        assert torch.equal(gg.tensor(n), st.tensor(n)), n
    layer = load_mtp_layer(dsa_model)
    assert layer.self_attn.indexer is not None  # its own indexer, as the file's block has


def test_mtp_greedy_is_the_plain_answer_without_guesses(dsa_model):
    prompt, params = _prompt(), SamplingParams(max_new_tokens=16)
    _, want, _ = Generator(dsa_model, _NoText()).generate(prompt, params)
    g = Generator(dsa_model, _NoText(), speculative="mtp", draft_max=4)
    _, got, _ = g.generate(prompt, params)
    assert got == want and g.last_stats.drafted_tokens == 0


def _reads(src, prefix: str) -> list[str]:
    """Spy on every tensor read of the weight source ``src``: the list of names under ``prefix`` read
    from now on."""
    seen: list[str] = []
    for meth in ("_load_native", "_load_as", "_load_into", "raw"):
        orig = getattr(src, meth)

        def spy(name, *a, _orig=orig, **k):
            if name.startswith(prefix):
                seen.append(name)
            return _orig(name, *a, **k)

        setattr(src, meth, spy)
    return seen


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_mtp_without_the_decode_step_loads_nothing_and_says_so_once(dsa_gguf, dsa_dir, dsa_family, fmt, caplog):
    m = load_model(dsa_gguf if fmt == "gguf" else dsa_dir, model_path=dsa_dir)
    reads = _reads(m.kt_weights, "model.layers.3.")
    prompt, params = _prompt(), SamplingParams(max_new_tokens=8)
    with caplog.at_level("WARNING"):
        g = Generator(m, _NoText(), speculative="mtp", draft_max=4)
        for _ in range(2):
            g.generate(prompt, params)
        Generator(m, _NoText(), speculative="mtp")
    assert g.last_stats.drafted_tokens == 0
    assert reads == [] and "_kt_mtp_layer" not in m.__dict__ and "_kt_mtp_run" not in m.__dict__
    said = [r.getMessage() for r in caplog.records if "speculative=mtp" in r.getMessage()]
    assert said == [f"speculative=mtp: {dsa_family} decodes without the one decode step (its sparse-attention "
                    "indexer is not served); MTP layer not loaded, plain decoding"], said
    load_mtp_layer(m)  # the spy sees the layer's reads where it is loaded
    assert "model.layers.3.eh_proj.weight" in reads and any(".self_attn." in n for n in reads), reads


def test_local_chat_says_it_once_on_stderr(dsa_dir, dsa_family):
    from tests.test_local_chat import run_chat

    r = run_chat("--model_path", dsa_dir, "--prompt", "abc abc abc abc abc", "--max_new_tokens", 8, "--stats",
                 "--cpu_infer", 1, "--temperature", 0, "--speculative", "mtp", "--draft_max", 3)
    assert r.returncode == 0, r.stderr
    said = [ln for ln in r.stderr.splitlines() if "speculative=mtp" in ln]
    assert len(said) == 1 and f"{dsa_family} decodes without the one decode step" in said[0], r.stderr
    assert "drafted" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_llama_cpps_files_without_the_block_are_refused(dsa_family):
    """llama.cpp's own conversions of the tiny models, which have no MTP layer."""
    m = load_model(ROOT / "tests" / "fixtures" / "llamacpp" / f"{dsa_family}.gguf")
    with pytest.raises(ConfigError) as e:
        Generator(m, _NoText(), speculative="mtp")
    msg = _one_line(e)
    assert "no MTP layer" in msg and f"'blk.{m.config.num_hidden_layers}.nextn.eh_proj.weight'" in msg, msg


@pytest.mark.parametrize("drop", ["blk.3.nextn.enorm.weight", "blk.3.indexer.proj.weight"])
def test_a_partial_block_names_the_missing_tensor(dsa_gguf, dsa_dir, tmp_path, drop):
    kind, msg = _refusal(_without(dsa_gguf, tmp_path / "partial.gguf", {drop}), dsa_dir)
    assert kind is WeightError and "MTP layer is incomplete" in msg and f"'{drop}'" in msg, msg


def test_fuzz_any_part_of_the_block_missing_is_named(dsa_gguf, dsa_dir, tmp_path_factory):
    check_any_part_missing_is_named(dsa_gguf, dsa_dir, tmp_path_factory)


def test_the_safetensors_checkpoints_layer_is_read_too(dsa_dir):
    m = load_model(dsa_dir, model_path=dsa_dir)
    layer = load_mtp_layer(m)
    assert layer.self_attn.indexer is not None and torch.equal(
        layer.enorm.weight, SafetensorsSource(dsa_dir / "model.safetensors").tensor("model.layers.3.enorm.weight"))


def test_a_glm5_mtp_layer_without_its_own_indexer(tmp_path):
    """GLM-5's per-layer indexer types: an MTP layer whose weights hold no indexer is written and read
    as a "shared" layer (as llama.cpp counts the block in ``attention.indexer.types``)."""
    d = write_mtp_checkpoint("glm_moe_dsa", tmp_path / "ckpt", own_indexer=False)
    path = convert(d, tmp_path / "f32.gguf", "F32", "F32", "F32", tokenizer=False)
    r = gguf.GGUFReader(path)
    assert r.fields["glm-dsa.attention.indexer.types"].contents() == [True, True, False, False]
    assert not any(t.name.startswith("blk.3.indexer.") for t in r.tensors)
    m = load_model(path, model_path=d)
    layer = load_mtp_layer(m)
    assert layer.self_attn.indexer is None and layer.eh_proj is not None
