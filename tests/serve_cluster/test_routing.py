"""The routing policy and the keys a request carries (no Ray needed)."""

from __future__ import annotations

import json

import pytest

from ktransformers.serve_cluster.routing import (BLOCK_CHARS, AffinityPolicy, NoLiveReplica, RouteKeys,
                                                 ids_in_response, route_keys)


def _chat(*contents):
    roles = ["user", "assistant"]
    return json.dumps({"model": "m", "messages": [{"role": roles[i % 2], "content": c}
                                                  for i, c in enumerate(contents)]}).encode()


def test_next_turn_matches_the_previous_turns_keys():
    turn1 = route_keys("/v1/chat/completions", _chat("hi"))
    turn2 = route_keys("/v1/chat/completions", _chat("hi", "hello!", "how are you?"))
    assert turn2.chain[:len(turn1.chain)] == turn1.chain
    other = route_keys("/v1/chat/completions", _chat("bye"))
    assert not set(other.chain) & set(turn1.chain)


def test_key_order_and_spacing_of_a_message_do_not_matter():
    a = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()
    b = b'{ "messages" : [ { "content":"x" , "role":"user" } ] }'
    assert route_keys("/v1/chat/completions", a) == route_keys("/v1/chat/completions", b)


def test_plain_prompts_share_keys_per_block():
    base = "p" * (3 * BLOCK_CHARS)
    a = route_keys("/api/generate", json.dumps({"prompt": base + "one"}).encode())
    b = route_keys("/api/generate", json.dumps({"prompt": base + "two"}).encode())
    assert a.chain[:3] == b.chain[:3] and a.chain[3] != b.chain[3]


def test_system_prompt_is_part_of_the_chain():
    a = route_keys("/api/generate", json.dumps({"prompt": "q", "system": "s1"}).encode())
    b = route_keys("/api/generate", json.dumps({"prompt": "q", "system": "s2"}).encode())
    assert a.chain != b.chain


@pytest.mark.parametrize("path, body, sticky", [
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_abc"}, ("resp_abc",)),
    ("/v1/responses", {"input": "x", "conversation": "conv_1"}, ("conv_1",)),
    ("/v1/responses", {"input": "x", "conversation": {"id": "conv_2"}}, ("conv_2",)),
    ("/v1/threads/thread_9/runs", {"assistant_id": "asst_1"}, ("thread_9",)),
    ("/v1/conversations/conv_3/items", None, ("conv_3",)),
])
def test_sticky_ids(path, body, sticky):
    assert route_keys(path, None if body is None else json.dumps(body).encode()).sticky == sticky


def test_ids_a_response_creates():
    head = b'data: {"type":"response.created","response":{"id":"resp_0123abcd","object":"response"}}'
    assert ids_in_response(head) == ["resp_0123abcd"]
    assert ids_in_response(b'{"id": "chatcmpl-1"}') == []


def test_owner_of_the_longest_prefix_wins():
    p = AffinityPolicy(["a", "b"])
    short, long_ = RouteKeys(chain=("k1",)), RouteKeys(chain=("k1", "k2"))
    p.record(short, "a")
    p.record(RouteKeys(chain=("k1", "k2")), "b")  # b served the longer conversation last
    assert p.choose(long_) == "b"
    assert p.choose(RouteKeys(chain=("k1", "k2", "k3"))) == "b"


def test_sticky_id_beats_the_prompt_chain():
    p = AffinityPolicy(["a", "b"])
    p.record(RouteKeys(chain=("k1",)), "a")
    p.learn_ids(["resp_x"], "b")
    assert p.choose(RouteKeys(sticky=("resp_x",), chain=("k1",))) == "b"


def test_new_conversations_spread_over_equally_loaded_replicas():
    p = AffinityPolicy(["a", "b"])
    assert {p.choose(RouteKeys(chain=(f"c{i}",))) for i in range(4)} == {"a", "b"}


def test_spill_to_the_least_loaded_past_the_threshold():
    p = AffinityPolicy(["a", "b"], spill_at=2)
    keys = RouteKeys(chain=("k",))
    p.record(keys, "a")
    p.started("a")
    assert p.choose(keys) == "a"  # below the threshold: affinity
    p.started("a")
    assert p.choose(keys) == "b"  # at it: b runs fewer
    for _ in range(3):
        p.started("b")
    assert p.choose(keys) == "a"  # b is busier still: no point in leaving a
    p.finished("a")
    assert p.choose(keys) == "a"


def test_a_replica_marked_down_gets_nothing_and_forgets_its_prefixes():
    p = AffinityPolicy(["a", "b"])
    keys = RouteKeys(sticky=("conv_1",), chain=("k",))
    p.record(keys, "a")
    p.mark_down("a")
    assert all(p.choose(RouteKeys(chain=(f"n{i}",))) == "b" for i in range(4))
    assert p.choose(keys) == "b"
    p.mark_up("a")
    assert "k" not in p.prefixes  # its cache died with it: the prefix is no longer a's
    assert p.choose(RouteKeys(sticky=("conv_1",))) == "a"  # its rows outlive the process
    p.mark_down("a")
    p.mark_down("b")
    with pytest.raises(NoLiveReplica):
        p.choose(keys)


def test_the_table_is_bounded():
    p = AffinityPolicy(["a"], max_keys=10)
    for i in range(100):
        p.record(RouteKeys(sticky=(f"resp_{i}",), chain=(f"k{i}",)), "a")
    assert len(p.prefixes) == 10 and len(p.ids) == 10 and "k99" in p.prefixes


@pytest.mark.parametrize("kw", [{"spill_at": 0}, {}])
def test_bad_policy_arguments(kw):
    with pytest.raises(ValueError):
        AffinityPolicy([] if not kw else ["a"], **kw)
