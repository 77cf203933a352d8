"""The fine-tuning inputs, fuzzed: a config or a dataset record ends in one named ConfigError
line or is read; never another exception."""

from __future__ import annotations

import json

import pytest

from ktransformers.errors import ConfigError
from ktransformers.sft.config import KEYS, parse_config
from ktransformers.sft.data import read_records, record_messages

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                      max_leaves=6)
KEY_NAMES = st.one_of(st.sampled_from(sorted(KEYS)), st.text(max_size=10))


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
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


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(RECORDS)
def test_fuzz_dataset_record_named_error_or_messages(rec):
    try:
        msgs = record_messages(rec, "d.jsonl:1")
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("d.jsonl:1"), str(e)
    else:
        assert msgs and all(isinstance(m.get("content"), str) for m in msgs), msgs


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_fuzz_dataset_file_bytes(tmp_path_factory, data):
    f = tmp_path_factory.mktemp("ds") / "d.jsonl"
    f.write_bytes(data + b'\n{"instruction": "a", "output": "b"}\n')
    try:
        for rec in read_records(f):
            json.dumps(rec)
    except ConfigError as e:
        assert "\n" not in str(e) and str(f) in str(e), str(e)
