"""Acknowledged writes survive replica kills: two replicas on one PostgreSQL (``--database_url``)
behind the router, two clients writing all the time (new conversations, and items appended to
one conversation both replicas write to), while each replica in turn is killed with SIGKILL
three times in all.  Every write answered 200 is read back afterwards, through the router."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (the cluster extra: pip install 'ktransformers[cluster]')")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (the cluster extra: ray[serve])")
import httpx  # noqa: E402
from ray import serve  # noqa: E402
from server.postgres_fixture import postgres  # noqa: E402,F401 - the fixture

from ktransformers.serve_cluster.deployments import build_app  # noqa: E402

from .conftest import MODEL_NAME  # noqa: E402
from .test_ray_cluster import _free_port, _replicas_up, _wait_all_up  # noqa: E402

APP = "kt-store-faults"
KILLS = 3


@pytest.fixture
def cluster_on_postgres(tiny_dir, tmp_path, postgres):  # noqa: F811
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        argv = ["--model_path", str(tiny_dir), "--model_name", MODEL_NAME, "--cpu_infer", "1",
                "--data_dir", str(tmp_path / "data"), "--database_url", postgres.new_database()]
        serve.run(build_app(argv, replicas=2, replica_cpus=0.5, spill_at=4, max_body_bytes=1 << 20,
                            health_check_period_s=1.0), name=APP, route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            _wait_all_up(client, 60)
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_no_acknowledged_write_is_lost_over_replica_kills(cluster_on_postgres):
    client = cluster_on_postgres
    shared = client.post("/v1/conversations", json={"metadata": {"role": "shared"}}).json()["id"]
    created: dict[str, str] = {}   # conversation id -> the metadata it was acknowledged with
    appended: list[str] = []       # texts of items acknowledged in the shared conversation
    attempts = {"n": 0, "refused": 0}
    stop = threading.Event()
    lock = threading.Lock()

    def writer(w: int):
        with httpx.Client(base_url=str(client.base_url), timeout=30) as c:
            i = 0
            while not stop.is_set():
                i += 1
                tag = f"w{w}-{i}"
                try:
                    r = c.post("/v1/conversations", json={"metadata": {"tag": tag}})
                    a = c.post(f"/v1/conversations/{shared}/items",
                               json={"items": [{"type": "message", "role": "user", "content": tag}]})
                except httpx.HTTPError:  # not acknowledged: nothing is owed
                    with lock:
                        attempts["n"] += 1
                        attempts["refused"] += 1
                    continue
                with lock:
                    attempts["n"] += 2
                    attempts["refused"] += (r.status_code != 200) + (a.status_code != 200)
                    if r.status_code == 200:
                        created[r.json()["id"]] = tag
                    if a.status_code == 200:
                        appended.append(tag)
                time.sleep(0.02)

    writers = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(2)]
    for t in writers:
        t.start()
    try:
        for k in range(KILLS):
            time.sleep(1.0)
            victim = f"replica-{k % 2}"
            pid = serve.get_deployment_handle(victim, app_name=APP).info.remote().result(timeout_s=30)["pid"]
            os.kill(pid, signal.SIGKILL)
            deadline = time.time() + 15
            while _replicas_up(client).get(victim, 1) and time.time() < deadline:
                time.sleep(0.2)  # the router notices (a failed call or its probes)
            _wait_all_up(client, 90)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in writers:
            t.join(30)
    print(f"{attempts['n']} writes, {attempts['refused']} not acknowledged, "
          f"{len(created)} conversations and {len(appended)} items acknowledged")
    assert len(created) > 10 and len(appended) > 10, (len(created), len(appended), attempts)
    for conv_id, tag in created.items():
        got = client.get(f"/v1/conversations/{conv_id}")
        assert got.status_code == 200 and got.json()["metadata"] == {"tag": tag}, (conv_id, got.text)
    items, after = [], None
    while True:
        page = client.get(f"/v1/conversations/{shared}/items", params={"limit": 100, "order": "asc",
                                                                       **({"after": after} if after else {})}).json()
        items += page["data"]
        if not page.get("has_more"):
            break
        after = page["last_id"]
    texts = {part["text"] for it in items for part in it.get("content", []) if "text" in part}
    assert set(appended) <= texts, sorted(set(appended) - texts)
