"""Corrupted GGUF files end in one named WeightError line before anything is sized from them
(or load, when the damage is harmless); ``--check_tensors`` finds NaN/Inf data."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from ktransformers.errors import ConfigError, WeightError

FIXTURE = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "qwen3moe-tiny" / "Q4_0.gguf"
needs_fixture = pytest.mark.skipif(not FIXTURE.is_file(), reason=f"{FIXTURE} is absent (shared fixtures)")
ARCH = "qwen3moe"


def corrupt(tmp_path: Path, edit, name: str = "c.gguf", fixture: Path = FIXTURE) -> Path:
    """A copy of the fixture with ``edit(reader)`` applied in place (gguf-py's writable mapping)."""
    import gguf

    p = tmp_path / name
    shutil.copyfile(fixture, p)
    p.chmod(0o644)
    r = gguf.GGUFReader(p, "r+")
    edit(r)
    r.data.flush()
    del r
    return p


def set_field(key: str, value):
    def edit(r):
        f = r.fields[key]
        f.parts[f.data[0]][0] = value
    return edit


def set_tensor(name: str, part: int, value, index: int = 0):
    """part 3: dims, 4: ggml type, 5: data offset (gguf-py's tensor-info field layout)."""
    def edit(r):
        t = next(t for t in r.tensors if t.name == name)
        t.field.parts[part][index] = value
    return edit


def cpu_seconds() -> float:
    """This process's CPU time, the clock of the bound on a case's work: the first open of a damaged
    tokenizer converts it (seconds of work) and wall time on a loaded machine multiplies that."""
    return time.process_time()


def outcome(path: Path, check_tensors: bool = False) -> str | None:
    """None when the file loads as far as a model is sized from it; the error line otherwise."""
    from ktransformers.weights import open_weights
    from ktransformers.weights.gguf_checks import preflight

    try:
        src = open_weights(path)
        cfg = src.config()
        src.validate(cfg)
        preflight(src, src.tokenizer(), str(path), check_tensors)
        return None
    except (WeightError, ConfigError) as e:
        msg = str(e)
        assert "\n" not in msg and str(path) in msg, msg
        return msg


# ---- the corruptions that used to crash, hang or load silently -------------------------------

CASES = [
    ("head_count 0", set_field(f"{ARCH}.attention.head_count", 0), "'qwen3moe.attention.head_count' is 0"),
    ("head_count_kv 0", set_field(f"{ARCH}.attention.head_count_kv", 0), "head_count_kv' is 0"),
    ("head_count_kv 3", set_field(f"{ARCH}.attention.head_count_kv", 3), "must divide head_count 4"),
    ("block_count 100000", set_field(f"{ARCH}.block_count", 100000), "'qwen3moe.block_count' is 100000"),
    ("block_count 0", set_field(f"{ARCH}.block_count", 0), "'qwen3moe.block_count' is 0"),
    ("block_count 1", set_field(f"{ARCH}.block_count", 1), "holds tensors of 2 layers"),
    ("block_count 3", set_field(f"{ARCH}.block_count", 3), "holds tensors of 2 layers"),
    ("embedding_length 0", set_field(f"{ARCH}.embedding_length", 0), "embedding_length' is 0"),
    ("embedding_length 255", set_field(f"{ARCH}.embedding_length", 255), "token_embd.weight is [1024, 256]"),
    ("negative rms epsilon", set_field(f"{ARCH}.attention.layer_norm_rms_epsilon", -1e-6), "rms_epsilon' is -9.99"),
    ("NaN rms epsilon", set_field(f"{ARCH}.attention.layer_norm_rms_epsilon", math.nan), "rms_epsilon' is nan"),
    ("NaN rope base", set_field(f"{ARCH}.rope.freq_base", math.nan), "freq_base' is nan"),
    ("Inf rope base", set_field(f"{ARCH}.rope.freq_base", math.inf), "freq_base' is inf"),
    ("zero rope base", set_field(f"{ARCH}.rope.freq_base", 0.0), "freq_base' is 0.0"),
    ("expert_count 4", set_field(f"{ARCH}.expert_count", 4), "stacks 8 experts"),
    ("expert_used_count 9", set_field(f"{ARCH}.expert_used_count", 9), "more than expert_count 8"),
    ("context_length 0", set_field(f"{ARCH}.context_length", 0), "context_length' is 0"),
    ("misaligned offset", set_tensor("output_norm.weight", 5, 278528 + 4), "not a multiple of the alignment 32"),
    ("shifted offset", set_tensor("output_norm.weight", 5, 278528 + 32), "the tensors before it end at"),
    ("offset past the end", set_tensor("blk.1.ffn_up_exps.weight", 5, 2**40), "runs past the end"),
    ("retyped Q4_0 -> Q8_0", set_tensor("blk.0.attn_q.weight", 4, 8), "the tensors before it end at"),
    ("retyped F32 -> F16", set_tensor("output_norm.weight", 4, 1), "the tensors before it end at"),
    ("unknown type id", set_tensor("output_norm.weight", 4, 77), "unknown ggml type id 77"),
    ("zero dimension", set_tensor("output_norm.weight", 3, 0), "dimensions [0]"),
    ("huge dimension", set_tensor("blk.1.ffn_up_exps.weight", 3, 2**40, 2), "runs past the end of the file"),
    ("row not whole blocks", set_tensor("token_embd.weight", 3, 250), "is not a multiple of Q4_0 block size (32)"),
]


@needs_fixture
@pytest.mark.parametrize("kind, edit, needle", CASES, ids=[c[0] for c in CASES])
def test_corruption_named_before_anything_is_sized(tmp_path, kind, edit, needle):
    t0 = cpu_seconds()
    msg = outcome(corrupt(tmp_path, edit))
    assert msg is not None and needle in msg, msg
    assert cpu_seconds() - t0 < 30
@needs_fixture
def test_fixture_itself_loads_and_scans_clean(tmp_path):
    assert outcome(corrupt(tmp_path, lambda r: None), check_tensors=True) is None


def _data_of(r, name):
    t = next(t for t in r.tensors if t.name == name)
    return t.data.reshape(-1).view(np.uint8)


@needs_fixture
@pytest.mark.parametrize("tensor, fill, needle", [
    ("output_norm.weight", "nan", "tensor 'output_norm.weight' (F32 [256]) holds NaN or Inf (first at row 0, column 3)"),
    ("blk.0.attn_q.weight", "ff", "tensor 'blk.0.attn_q.weight' (Q4_0 [256, 256]) holds NaN or Inf"),
    ("token_embd.weight", "inf-scale", "tensor 'token_embd.weight' (Q4_0 [1024, 256]) holds NaN or Inf (first at row 1"),
])
def test_check_tensors_finds_nan_and_inf(tmp_path, tensor, fill, needle):
    def edit(r):
        d = _data_of(r, tensor)
        if fill == "nan":
            d.view(np.float32)[3] = np.nan
        elif fill == "ff":
            d[:] = 0xFF
        else:  # the f16 scale of the first block of row 1 -> +Inf
            d[8 * 18: 8 * 18 + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    p = corrupt(tmp_path, edit)
    assert outcome(p) is None  # the header is fine: only reading the data can tell
    msg = outcome(p, check_tensors=True)
    assert msg is not None and needle in msg, msg


# ---- a corpus: every header byte region truncated, every numeric field swept ----------------

def _numeric_fields(fixture: Path = FIXTURE):
    import gguf

    r = gguf.GGUFReader(fixture)
    out = []
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or not f.data or len(f.data) != 1:
            continue
        v = f.parts[f.data[0]]
        if v.dtype.kind in "uif" and v.size == 1:
            out.append((k, v.dtype))
    return out


SWEEP = [0, 1, 7, 2**31 - 1]


DEEPSEEK = FIXTURE.parents[1] / "deepseek2-tiny" / "Q4_0.gguf"


@needs_fixture
@pytest.mark.parametrize("fixture", [FIXTURE, DEEPSEEK], ids=["qwen3moe", "deepseek2"])
def test_corpus_every_numeric_field_swept(tmp_path, fixture):
    if not fixture.is_file():
        pytest.skip(f"{fixture} is absent (shared fixtures)")
    n, errors = 0, 0
    for key, dtype in _numeric_fields(fixture):
        values = SWEEP + ([-1.0, math.nan, math.inf, 1e30] if dtype.kind == "f" else [np.iinfo(dtype).max])
        for v in values:
            try:
                cast = np.array(v).astype(dtype)
            except (OverflowError, ValueError):
                continue
            if dtype.kind == "u" and (isinstance(v, float) or v < 0):
                continue
            p = corrupt(tmp_path, set_field(key, cast[()]), f"f{n}.gguf", fixture)
            t0 = cpu_seconds()
            errors += outcome(p) is not None
            assert cpu_seconds() - t0 < 30, (key, v)
            p.unlink()
            n += 1
    assert n >= 70 and errors >= n // 3, (n, errors)
@needs_fixture
def test_corpus_truncated_everywhere(tmp_path):
    data = FIXTURE.read_bytes()
    cuts = list(range(0, 2600, 97)) + [len(data) - 1, len(data) - 4096, len(data) // 2]
    for cut in cuts:
        p = tmp_path / f"t{cut}.gguf"
        p.write_bytes(data[:cut])
        assert outcome(p) is not None, cut
        p.unlink()
    assert len(cuts) >= 25


# ---- property-based: random bytes in the header ------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

HEADER_END = 2592  # where the fixture's tensor data starts


@needs_fixture
@fuzz_settings(120, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, HEADER_END - 1), st.integers(0, 255)), min_size=1, max_size=6))
def test_fuzz_gguf_header_named_error_or_success(tmp_path, edits):
    def edit(r):
        for pos, byte in edits:
            r.data[pos] = byte
    try:
        p = corrupt(tmp_path, edit, "h.gguf")
    except Exception:  # gguf-py itself cannot map the damaged copy: apply the bytes by hand
        p = tmp_path / "h.gguf"
        raw = bytearray(FIXTURE.read_bytes())
        for pos, byte in edits:
            raw[pos] = byte
        p.write_bytes(bytes(raw))
    t0 = cpu_seconds()
    outcome(p)
    assert cpu_seconds() - t0 < 30


# ---- keys written into a tiny Gemma-3 file: sliding window, special token ids -------------------

def with_metadata(src: Path, dst: Path, fields: dict) -> Path:
    """A copy of ``src`` with ``fields`` (key -> (GGUFValueType, value)) set or added, by gguf-py's
    own metadata copier."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch=r.get_field("general.architecture").contents(), endianess=r.endianess)
    copy_with_new_metadata(r, w, {k: MetadataDetails(t, v) for k, (t, v) in fields.items()}, [])
    return dst


@pytest.fixture(scope="module")
def tiny_gemma(tiny_model_dir, tmp_path_factory):
    """A tiny random Gemma-3 GGUF with its tokenizer (vocabulary of 320 tokens, sliding window 8)."""
    from ktransformers.convert import convert

    return convert(tiny_model_dir("gemma3_text"), tmp_path_factory.mktemp("gemma") / "g.gguf", "F32", "F32", "F32")


def _special_token_keys():
    from gguf.constants import Keys

    return sorted(v for k, v in vars(Keys.Tokenizer).items() if k.endswith("_ID"))


def test_tiny_gemma_loads(tiny_gemma):
    assert outcome(tiny_gemma) is None


@pytest.mark.parametrize("key, kind, value, needle", [
    ("gemma3.attention.sliding_window", "UINT32", 0, "'gemma3.attention.sliding_window' is 0; expected 1.."),
    ("gemma3.attention.sliding_window", "UINT32", 2**31, "'gemma3.attention.sliding_window' is 2147483648; expected 1.."),
    ("tokenizer.ggml.bos_token_id", "UINT32", 320, "'tokenizer.ggml.bos_token_id' is 320, outside the vocabulary of 320"),
    ("tokenizer.ggml.eos_token_id", "UINT32", 2**32 - 1, "'tokenizer.ggml.eos_token_id' is 4294967295, outside"),
    ("tokenizer.ggml.padding_token_id", "INT32", -1, "'tokenizer.ggml.padding_token_id' is -1, outside"),
    ("tokenizer.ggml.unknown_token_id", "UINT32", 100000, "'tokenizer.ggml.unknown_token_id' is 100000, outside"),
    ("tokenizer.ggml.eot_token_id", "UINT32", 5000, "'tokenizer.ggml.eot_token_id' is 5000, outside"),
    ("tokenizer.ggml.eom_token_id", "UINT32", 320, "'tokenizer.ggml.eom_token_id' is 320, outside"),
    ("tokenizer.ggml.eos_token_id", "STRING", "2", "'tokenizer.ggml.eos_token_id' must be a token id"),
])
def test_gemma_key_named(tiny_gemma, tmp_path, key, kind, value, needle):
    import gguf

    p = with_metadata(tiny_gemma, tmp_path / "k.gguf", {key: (gguf.GGUFValueType[kind], value)})
    msg = outcome(p)
    assert msg is not None and needle in msg, msg


@fuzz_settings(40, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(key=st.sampled_from(["gemma3.attention.sliding_window"] + _special_token_keys()),
       value=st.one_of(st.integers(-2**31, 2**32 - 1), st.sampled_from([0, 1, 319, 320, 1 << 20, (1 << 20) + 1]),
                       st.booleans(), st.floats(allow_nan=True), st.text(max_size=4)))
def test_fuzz_gemma_window_and_token_ids(tiny_gemma, tmp_path, key, value):
    """Any value for the window or a special token id: loads exactly when it is in range, else one
    line naming the key."""
    import gguf

    T = gguf.GGUFValueType
    kind = (T.BOOL if isinstance(value, bool) else T.INT64 if isinstance(value, int)
            else T.FLOAT64 if isinstance(value, float) else T.STRING)
    p = with_metadata(tiny_gemma, tmp_path / "f.gguf", {key: (kind, value)})
    t0 = cpu_seconds()
    msg = outcome(p)
    assert cpu_seconds() - t0 < 30
    window = key.endswith("sliding_window")
    valid = (kind == T.INT64 and (1 <= value <= 1 << 20 if window else 0 <= value < 320))
    if valid:
        assert msg is None, (key, value, msg)
    else:
        assert msg is not None and f"'{key}'" in msg, (key, value, msg)


# ---- the MTP block's count on llama.cpp's own tiny GLM-4-MoE file -------------------------------

GLM4_MOE = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "glm4_moe.gguf"


@fuzz_settings(30, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=st.one_of(st.integers(-2**31, 2**32 - 1), st.integers(0, 5), st.booleans(),
                       st.floats(allow_nan=True), st.text(max_size=4)))
def test_fuzz_nextn_predict_layers(tmp_path, value):
    """Any ``nextn_predict_layers`` for a file of ``block_count`` 4 with tensors of 3 layers (llama.cpp
    counts the MTP block it keeps, here none): loads, with ``4 - value`` layers, exactly when 1..3
    blocks are left and the missing one can be an MTP block; else one line naming a key."""
    import gguf

    T = gguf.GGUFValueType
    kind = (T.BOOL if isinstance(value, bool) else T.INT64 if isinstance(value, int)
            else T.FLOAT64 if isinstance(value, float) else T.STRING)
    p = with_metadata(GLM4_MOE, tmp_path / "n.gguf", {"glm4moe.nextn_predict_layers": (kind, value)})
    msg = outcome(p)
    if kind == T.INT64 and 1 <= value <= 3:
        assert msg is None, (value, msg)
    elif kind == T.INT64 and value == 0:
        assert msg is not None and "'glm4moe.block_count' is 4, but the file holds tensors of 3 layers" in msg, msg
    else:
        assert msg is not None and "'glm4moe.nextn_predict_layers'" in msg, (value, msg)
