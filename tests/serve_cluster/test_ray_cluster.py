"""Two replicas of the tiny model on a local Ray cluster (loopback only), through the router:
the server's routes and streams unchanged, a conversation kept on one replica, /metrics of both
under a replica label, and a replica killed with SIGKILL mid-stream: the stream ends with an
error event, the next request is served by the live replica, Ray brings the dead one back."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (the cluster extra: pip install 'ktransformers[cluster]')")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (the cluster extra: ray[serve])")
import httpx  # noqa: E402
from ray import serve  # noqa: E402

from ktransformers.serve_cluster.deployments import build_app  # noqa: E402

from .conftest import MODEL_NAME  # noqa: E402

APP = "kt-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        argv = ["--model_path", str(tiny_dir), "--model_name", MODEL_NAME, "--cpu_infer", "1",
                "--max_new_tokens", "8", "--data_dir", str(tmp_path_factory.mktemp("cluster-data"))]
        serve.run(build_app(argv, replicas=2, replica_cpus=0.5, spill_at=4, max_body_bytes=1 << 20,
                            health_check_period_s=1.0), name=APP, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=60) as client:
            _wait_all_up(client, 60)
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()


def _replicas_up(client) -> dict[str, int]:
    text = client.get("/metrics").text
    return {line.split('"')[1]: int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines() if line.startswith("ktransformers_cluster_replica_up{")}


def _wait_all_up(client, seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        up = _replicas_up(client)
        if up and all(up.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"replicas not all up after {seconds}s: {_replicas_up(client)}")


def _chat(client, messages, **kw):
    r = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 8,
                                                  "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.headers["x-served-by"]


def test_the_servers_routes_through_the_router(cluster):
    text, who = _chat(cluster, [{"role": "user", "content": "Hello"}])
    assert who in ("replica-0", "replica-1")
    # a streamed Ollama chat: NDJSON lines, the last one done
    with cluster.stream("POST", "/api/chat", json={"model": MODEL_NAME, "stream": True,
                                                   "messages": [{"role": "user", "content": "Hi"}]}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1]["done"] is True
    # the server's own validation, answered by a replica in the OpenAI shape
    bad = cluster.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": "nope"})
    assert bad.status_code in (400, 422) and "error" in bad.json()


def test_a_conversation_stays_on_one_replica(cluster):
    for client_id in range(2):
        messages, served = [], set()
        for turn in range(3):
            messages.append({"role": "user", "content": f"client {client_id} says {turn} " * 4})
            answer, who = _chat(cluster, messages)
            served.add(who)
            messages.append({"role": "assistant", "content": answer})
        assert len(served) == 1, served
    first = cluster.post("/v1/responses", json={"model": MODEL_NAME, "input": "Remember 7", "max_output_tokens": 4})
    assert first.status_code == 200, first.text
    follow = cluster.post("/v1/responses", json={"model": MODEL_NAME, "input": "What was it?",
                                                 "previous_response_id": first.json()["id"],
                                                 "max_output_tokens": 4})
    assert follow.status_code == 200, follow.text
    assert follow.headers["x-served-by"] == first.headers["x-served-by"]


def test_metrics_of_each_replica_under_a_label(cluster):
    text = cluster.get("/metrics").text
    for name in ("replica-0", "replica-1"):
        assert f'ktransformers_requests_running{{replica="{name}"}}' in text


def test_a_replica_killed_mid_stream(cluster):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "count"}], "stream": True,
            "max_tokens": 1500, "temperature": 0}
    with cluster.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        victim = r.headers["x-served-by"]
        pid = serve.get_deployment_handle(victim, app_name=APP).info.remote().result()["pid"]
        lines = []
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 3:
                os.kill(pid, signal.SIGKILL)
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert err["code"] == "replica_lost" and victim in err["message"]
    # the next request goes to the live replica, at once
    t0 = time.time()
    _, who = _chat(cluster, [{"role": "user", "content": "still there?"}])
    assert who != victim and time.time() - t0 < 10
    # Ray restarts the dead one; the router routes to it again
    _wait_all_up(cluster, 60)
    new_pid = serve.get_deployment_handle(victim, app_name=APP).info.remote().result()["pid"]
    assert new_pid != pid
