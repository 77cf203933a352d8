"""The fine-tuning inputs, fuzzed: a config or a dataset record ends in one named ConfigError
line or is read; never another exception."""

from __future__ import annotations

import json

import pytest

from ktransformers.errors import ConfigError
from ktransformers.sft.config import KEYS, parse_config
from ktransformers.sft.data import read_records, record_messages

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                      max_leaves=6)
KEY_NAMES = st.one_of(st.sampled_from(sorted(KEYS)), st.text(max_size=10))


@fuzz_settings(300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(KEY_NAMES, VALUES, max_size=6))
def test_fuzz_config_named_error_or_read(cfg):
    import yaml

    text = yaml.safe_dump(cfg, allow_unicode=True)
    try:
        parse_config(text, "c.yaml")
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("c.yaml"), str(e)


RECORD_KEYS = st.sampled_from(["instruction", "input", "output", "system", "history", "conversations",
                               "messages", "from", "value", "role", "content"])
RECORDS = st.recursive(SCALARS | st.dictionaries(RECORD_KEYS, SCALARS, max_size=4),
                       lambda c: st.lists(c, max_size=4) | st.dictionaries(RECORD_KEYS, c, max_size=4),
                       max_leaves=12)


@fuzz_settings(400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(RECORDS)
def test_fuzz_dataset_record_named_error_or_messages(rec):
    try:
        msgs = record_messages(rec, "d.jsonl:1")
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("d.jsonl:1"), str(e)
    else:
        assert msgs and all(isinstance(m.get("content"), str) for m in msgs), msgs


@fuzz_settings(100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_fuzz_dataset_file_bytes(tmp_path_factory, data):
    f = tmp_path_factory.mktemp("ds") / "d.jsonl"
    f.write_bytes(data + b'\n{"instruction": "a", "output": "b"}\n')
    try:
        for rec in read_records(f):
            json.dumps(rec)
    except ConfigError as e:
        assert "\n" not in str(e) and str(f) in str(e), str(e)


# -- adapters with expert LoRA, applied on the inference rules -------------------------------------------

EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def expert_adapter(tmp_path_factory):
    """(tiny Qwen3-MoE folder, (adapter config, tensors)) of a valid PEFT adapter with LoRA on the experts and q_proj."""
    import torch
    from safetensors.torch import load_file

    from ktransformers.util.tiny_models import write_tiny_model

    from .test_expert_adapter_inference import write_peft_adapter

    root = tmp_path_factory.mktemp("fuzz-adapter")
    write_tiny_model("qwen3_moe", root / "m", seed=0)
    ad = write_peft_adapter(root / "m", root / "a", target_modules=["q_proj"], r=2)
    sd = load_file(str(ad / "adapter_model.safetensors"))
    assert any(".experts." in k for k in sd) and all(t.dtype == torch.float32 for t in sd.values())
    return root / "m", (json.loads((ad / "adapter_config.json").read_text()), sd)


def _mutate(cfg: dict, sd: dict, op: tuple):
    import torch

    kind, i, v = op
    keys = sorted(sd)
    k = keys[i % len(keys)]
    if kind == "drop":
        sd.pop(k)
    elif kind == "rename":
        sd[k.replace("lora_A", "lora_C") if "lora_A" in k else k + "x"] = sd.pop(k)
    elif kind == "reshape":
        t = sd[k]
        sd[k] = torch.zeros(*(s + v % 3 - 1 or 1 for s in t.shape)) if v % 2 else t.reshape(-1)
    elif kind == "extra":
        sd[k.replace("layers.0", "layers.7")] = sd[k]
    elif kind == "dtype":
        sd[k] = sd[k].to(torch.float16 if v % 2 else torch.int32)
    elif kind == "r":
        cfg["r"] = v
    elif kind == "alpha":
        cfg["lora_alpha"] = v
    elif kind == "targets":
        cfg["target_parameters"] = [["mlp.experts.gate_proj"], ["mlp.experts.x"], [], None, EXPERT_TARGETS[:1],
                                    ["self_attn.q_proj.weight"], ["mlp.experts.down_proj"] * 2][v % 7]
    elif kind == "rslora":
        cfg["use_rslora"] = bool(v % 2)


MUTATIONS = st.lists(st.tuples(st.sampled_from(["drop", "rename", "reshape", "extra", "dtype", "r", "alpha",
                                                "targets", "rslora"]),
                               st.integers(0, 1000), st.integers(-3, 70)), min_size=1, max_size=3)


@fuzz_settings(40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(MUTATIONS)
def test_fuzz_expert_adapter_named_error_or_applied(tmp_path_factory, expert_adapter, ops):
    """A damaged adapter with expert LoRA, loaded on the inference rules: one ConfigError line
    naming the adapter folder, or a model that runs and gives finite logits."""
    import copy

    import torch
    from safetensors.torch import save_file

    from ktransformers.loading import load_model

    model_dir, (cfg0, sd0) = expert_adapter
    cfg, sd = copy.deepcopy(cfg0), dict(sd0)
    for op in ops:
        _mutate(cfg, sd, op)
    folder = tmp_path_factory.mktemp("ad")
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({k: v.clone().contiguous() for k, v in sd.items()}, str(folder / "adapter_model.safetensors"))
    try:
        model = load_model(model_dir, lora=folder)
    except ConfigError as e:
        assert "\n" not in str(e) and str(folder) in str(e), str(e)
        return
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


# ---- command-line overrides and chat template files ---------------------------------------------

OVERRIDE_KEYS = st.one_of(st.sampled_from(sorted(KEYS)), st.text(max_size=8))


@fuzz_settings(300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(OVERRIDE_KEYS, st.text(max_size=12)), min_size=1, max_size=3))
def test_fuzz_overrides_error_names_the_override_or_the_file_line(tmp_path_factory, pairs):
    """An error in a ``key=value`` override names that override, never a line past the file's end."""
    from ktransformers.sft.__main__ import _with_overrides

    f = tmp_path_factory.mktemp("cfg") / "c.yaml"
    f.write_text("model_name_or_path: m\ndataset: d.json\noutput_dir: out\n")
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        _with_overrides(str(f), overrides)
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg, msg
        if msg.startswith(str(f) + ":"):
            line = msg[len(str(f)) + 1:].split(":")[0]
            assert line.isdigit() and int(line) <= 3, msg
        else:
            assert msg.startswith(("command-line override", str(f))), msg


JINJA_BITS = st.sampled_from(["{{ ", " }}", "{% ", " %}", "{# ", " #}", "if", "for m in messages", "endfor", "endif",
                              "messages[0]['content']", "raise_exception('x')", "foo.bar", "|trim", "\n", "(", "]",
                              "bos_token", "add_generation_prompt", "'", "{%- ", " -%}", "loop.", "range(10**9)"])


@fuzz_settings(300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(JINJA_BITS | st.text(max_size=4), max_size=14).map("".join) | st.binary(max_size=24))
def test_fuzz_chat_template_file_named_error_or_used(tmp_path_factory, body):
    """A ``--chat_template`` / ``chat_template:`` file is used, or one ConfigError line names it."""
    from ktransformers.util.chat_templates import use_chat_template
    from ktransformers.util.tiny_models import make_tiny_tokenizer

    f = tmp_path_factory.mktemp("tpl") / "t.jinja"
    f.write_bytes(body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass"))
    tok = make_tiny_tokenizer()
    try:
        use_chat_template(tok, str(f))
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith(str(f)), str(e)
    else:
        assert tok.chat_template == f.read_text(encoding="utf-8") and tok.kt_template_origin == str(f)
