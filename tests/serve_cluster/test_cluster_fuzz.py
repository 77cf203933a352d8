"""The router's inputs, fuzzed: any request body and path gives routing keys (never an
exception: the router reads bodies before any replica validates them), the policy always names a
live replica whatever happened before, and a bad cluster flag is one ``error:`` line and exit 2."""

from __future__ import annotations

import json

import pytest

from ktransformers.serve_cluster.cli import main
from ktransformers.serve_cluster.routing import AffinityPolicy, NoLiveReplica, RouteKeys, ids_in_response, route_keys

hypothesis = pytest.importorskip("hypothesis")
from fuzzing import fuzz_settings  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)
FIELDS = st.sampled_from(["messages", "input", "prompt", "system", "instructions", "previous_response_id",
                          "conversation", "thread_id", "model"])
BODIES = st.one_of(
    st.binary(max_size=300),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(FIELDS, JSON, max_size=5).map(lambda d: json.dumps(d).encode()),
    st.just(b"[" * 100000 + b"]" * 100000),  # deeper than json's recursion limit
    st.just(b'{"messages": [{"role": "user", "content": "\\ud800"}], "prompt": "\\udfff"}'),  # lone surrogates
)
PATHS = st.one_of(st.sampled_from(["/v1/chat/completions", "/api/generate", "/v1/responses",
                                   "/v1/threads/thread_1/runs", "/v1/conversations/conv_x/items"]),
                  st.text(max_size=40).map(lambda t: "/" + t))


@fuzz_settings(300, deadline=None, database=None)
@given(PATHS, BODIES)
def test_any_request_gives_keys(path, body):
    keys = route_keys(path, body)
    assert isinstance(keys, RouteKeys)
    assert all(isinstance(k, str) and k for k in keys.all())
    assert route_keys(path, body) == keys  # the same request always routes the same way
    assert all(isinstance(i, str) for i in ids_in_response(body))


OPS = st.lists(st.tuples(st.sampled_from(["choose", "started", "finished", "down", "up", "record", "learn"]),
                         st.integers(0, 2), st.lists(st.sampled_from(["k1", "k2", "k3"]), max_size=3)),
               max_size=60)


@fuzz_settings(200, deadline=None, database=None)
@given(OPS, st.integers(1, 3))
def test_policy_names_a_live_replica_whatever_happened(ops, spill_at):
    names = ["a", "b", "c"]
    p = AffinityPolicy(names, spill_at=spill_at)
    for op, i, ks in ops:
        name, keys = names[i], RouteKeys(sticky=tuple(f"resp_{k}" for k in ks[:1]), chain=tuple(ks))
        if op == "choose":
            try:
                chosen = p.choose(keys)
            except NoLiveReplica:
                assert not p.live()
            else:
                assert chosen in p.live()
                owner = p.owner(keys)
                if owner is not None and p.in_flight[owner] < spill_at:
                    assert chosen == owner
        elif op == "started":
            p.started(name)
        elif op == "finished":
            p.finished(name)
        elif op == "down":
            p.mark_down(name)
        elif op == "up":
            p.mark_up(name)
        elif op == "record":
            p.record(keys, name)
        else:
            p.learn_ids(keys.sticky, name)
        assert all(n >= 0 for n in p.in_flight.values())


VALUES = st.one_of(st.integers(-(2**70), 2**70).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   st.sampled_from(["", " ", "nan", "inf", "1e400", "two", "0x10"]), st.text(max_size=6))


@fuzz_settings(150, deadline=None, database=None)
@given(st.sampled_from(["--replicas", "--replica_cpus", "--replica_memory_gb", "--spill_at"]), VALUES)
def test_cluster_flags_refused_in_one_line(flag, value):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main([f"{flag}={value}", "--model_path", "/nonexistent/model"])
        except SystemExit as e:
            rc = e.code
    out = err.getvalue().strip()
    assert rc == 2
    assert out.startswith("error: ") and "\n" not in out and "Traceback" not in out
    assert flag in out or "--model_path" in out  # the flag's own refusal, else the next one's
