"""The MTP drafter from a GGUF (generation/mtp.py; the names: weights/gguf_names.py ``_NEXTN``).

The tiny DeepSeek-V3 and GLM-4-MoE checkpoints of test_mtp.py (an MTP layer after three decoder
layers) converted by our converter at F32, the MTP block written as llama.cpp's converter writes
GLM-4.5's: its decoder layer as ``blk.3.*``, its own tensors as ``blk.3.nextn.*`` (names checked
against llama.cpp's gguf-py ``MODEL_TENSOR.NEXTN_*`` list, written out here), ``block_count`` 4 and
``nextn_predict_layers`` 1.  From that file:

* the model has three layers, and every tensor of the MTP layer is the checkpoint's, bit for bit;
* the drafter's guesses are the ones it makes from the safetensors load, guess for guess;
* greedy answers with ``speculative="mtp"`` are the plain answers token for token;
* a file without the block (llama.cpp's own tiny GLM-4-MoE / DeepSeek-V3 files) is refused with one
  line naming the tensor it lacks; a file with part of the block with one line naming a missing
  tensor by its GGUF name (fuzzed over which part is missing).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
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
from .test_mtp import _prompt, family, model, mtp_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
#: llama.cpp's names of the MTP block's own tensors (gguf-py constants.py, ``MODEL_TENSOR.NEXTN_*``)
LLAMA_CPP_NEXTN = {"blk.3.nextn.eh_proj.weight", "blk.3.nextn.enorm.weight", "blk.3.nextn.hnorm.weight",
                   "blk.3.nextn.shared_head_norm.weight"}
ARCH = {"deepseek_v3": "deepseek2", "glm4_moe": "glm4moe"}


@pytest.fixture(scope="module")
def mtp_gguf(mtp_dir, tmp_path_factory) -> Path:
    return convert(mtp_dir, tmp_path_factory.mktemp("mtp-gguf") / "f32.gguf", "F32", "F32", "F32", tokenizer=False)


@pytest.fixture(scope="module")
def gguf_model(mtp_gguf, mtp_dir):
    return load_model(mtp_gguf, model_path=mtp_dir)


def _one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_the_file_holds_the_block_as_llama_cpp_writes_it(mtp_gguf, family):
    r = gguf.GGUFReader(mtp_gguf)
    A = ARCH[family]
    assert r.fields[f"{A}.block_count"].contents() == 4 and r.fields[f"{A}.nextn_predict_layers"].contents() == 1
    names = {t.name for t in r.tensors}
    assert {n for n in names if ".nextn." in n} == LLAMA_CPP_NEXTN
    assert "blk.3.attn_norm.weight" in names and "blk.3.ffn_gate_exps.weight" in names
    assert GGUFSource(mtp_gguf).config().num_hidden_layers == 3


def test_the_mtp_layer_from_the_gguf_is_the_checkpoints(mtp_gguf, mtp_dir, gguf_model):
    st, gg = SafetensorsSource(mtp_dir / "model.safetensors"), GGUFSource(mtp_gguf)
    names = [n for n in st.names() if n.startswith("model.layers.3.") and "embed_tokens" not in n
             and "shared_head.head" not in n]  # the experts stacked, as both serve them
    assert len(names) > 10 and "model.layers.3.eh_proj.weight" in names
    for n in names:
        assert torch.equal(gg.tensor(n), st.tensor(n)), n
    assert gguf_model.config.num_hidden_layers == 3 and len(gguf_model.model.layers) == 3
    assert load_mtp_layer(gguf_model) is not None


def _guesses(model, monkeypatch, pattern=(3,)) -> list:
    from ktransformers.generation.mtp import MTPDrafter
    from ktransformers.generation.speculative import Policy

    seen, own = [], MTPDrafter.draft

    def draft(self, k):
        got = own(self, k)
        seen.append((list(self.tokens), got))
        return got

    with monkeypatch.context() as m:
        m.setattr(MTPDrafter, "draft", draft)
        ks = iter(pattern * 100)
        m.setattr(Policy, "next_k", lambda self: next(ks))  # guess by the pattern, however few are kept
        Generator(model, _NoText(), speculative="mtp", draft_max=3).generate(_prompt(seed=8),
                                                                             SamplingParams(max_new_tokens=30))
    return seen


def test_guesses_from_the_gguf_are_the_safetensors_ones(gguf_model, model, monkeypatch):
    want = _guesses(model, monkeypatch)
    got = _guesses(gguf_model, monkeypatch)
    assert sum(len(g) for _, g in want) >= 20
    assert got == want


def test_mtp_greedy_from_the_gguf_is_the_plain_answer(gguf_model):
    prompt = _prompt()
    params = SamplingParams(max_new_tokens=32)
    _, want, _ = Generator(gguf_model, _NoText()).generate(prompt, params)
    g = Generator(gguf_model, _NoText(), speculative="mtp", draft_max=4)
    _, got, _ = g.generate(prompt, params)
    assert got == want and g.last_stats.drafted_tokens > 0


@pytest.mark.parametrize("fixture", ["glm4_moe", "deepseek_v3"])
def test_llama_cpps_files_without_the_block_are_refused(fixture):
    """llama.cpp's own conversions of tiny models that have no MTP layer (and its converter drops
    DeepSeek-V3's)."""
    m = load_model(ROOT / "tests" / "fixtures" / "llamacpp" / f"{fixture}.gguf")
    with pytest.raises(ConfigError) as e:
        Generator(m, _NoText(), speculative="mtp")
    msg = _one_line(e)
    n = m.config.num_hidden_layers
    assert "no MTP layer" in msg and f"'blk.{n}.nextn.eh_proj.weight'" in msg, msg


def _without(src: Path, dst: Path, drop) -> Path:
    """``src`` with the tensors ``drop`` left out (metadata as it is)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch=str(r.fields["general.architecture"].contents()))
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed(t.shape.tolist())),
                         raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _refusal(path: Path, mtp_dir: Path) -> tuple[type, str]:
    m = load_model(path, model_path=mtp_dir)
    with pytest.raises((ConfigError, WeightError)) as e:
        Generator(m, _NoText(), speculative="mtp")
    return e.type, _one_line(e)


@pytest.mark.parametrize("drop", ["blk.3.nextn.hnorm.weight", "blk.3.attn_output.weight"])
def test_a_partial_block_names_the_missing_tensor(mtp_gguf, mtp_dir, tmp_path, drop):
    kind, msg = _refusal(_without(mtp_gguf, tmp_path / "partial.gguf", {drop}), mtp_dir)
    assert kind is WeightError and "MTP layer is incomplete" in msg and f"'{drop}'" in msg, msg


def test_a_file_without_the_nextn_tensors_has_no_mtp_layer(mtp_gguf, mtp_dir, tmp_path):
    kind, msg = _refusal(_without(mtp_gguf, tmp_path / "none.gguf", LLAMA_CPP_NEXTN), mtp_dir)
    assert kind is ConfigError and "no MTP layer" in msg and "'blk.3.nextn.eh_proj.weight'" in msg, msg


def test_fuzz_any_part_of_the_block_missing_is_named(mtp_gguf, mtp_dir, tmp_path_factory):
    check_any_part_missing_is_named(mtp_gguf, mtp_dir, tmp_path_factory)


def check_any_part_missing_is_named(mtp_gguf: Path, mtp_dir: Path, tmp_path_factory) -> None:
    """Any non-empty set of the MTP block's tensors left out: one line, naming the first missing
    ``nextn`` tensor (MTP_TENSORS' order), or with all four gone "no MTP layer", or else one of the
    decoder layer's missing tensors."""
    from hypothesis import HealthCheck, given
    from hypothesis import strategies as st

    from ktransformers.generation.mtp import MTP_TENSORS
    from tests.fuzzing import fuzz_settings

    block = sorted(t.name for t in gguf.GGUFReader(mtp_gguf).tensors if t.name.startswith("blk.3."))
    own = {"eh_proj.weight": "eh_proj", "enorm.weight": "enorm", "hnorm.weight": "hnorm",
           "shared_head.norm.weight": "shared_head_norm"}
    order = [f"blk.3.nextn.{own[t]}.weight" for t in MTP_TENSORS]

    @fuzz_settings(6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sets(st.sampled_from(block), min_size=1, max_size=4))
    def check(drop):
        path = _without(mtp_gguf, tmp_path_factory.mktemp("fuzz") / "f.gguf", drop)
        kind, msg = _refusal(path, mtp_dir)
        gone = [n for n in order if n in drop]
        if len(gone) == len(order):
            assert kind is ConfigError and "no MTP layer" in msg, msg
        elif gone:
            assert kind is WeightError and f"'{gone[0]}'" in msg, msg
        else:
            assert kind is WeightError and any(n in msg for n in drop), msg

    check()
