"""Assistants API (beta shapes) through the official ``openai`` client, SQLite persistence."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from .conftest import MODEL_NAME, start_server, stop_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_assistant_crud(client):
    a = client.beta.assistants.create(model=MODEL_NAME, name="helper", instructions="Be brief.",
                                      metadata={"k": "v"})
    assert a.id.startswith("asst_") and a.model == MODEL_NAME and a.metadata == {"k": "v"}
    assert client.beta.assistants.retrieve(a.id).name == "helper"
    b = client.beta.assistants.update(a.id, name="helper2")
    assert b.name == "helper2" and b.instructions == "Be brief."
    assert a.id in [x.id for x in client.beta.assistants.list(limit=100)]
    assert client.beta.assistants.delete(a.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.beta.assistants.retrieve(a.id)


def test_thread_and_messages(client):
    t = client.beta.threads.create(messages=[{"role": "user", "content": "first"}], metadata={"title": "x"})
    m2 = client.beta.threads.messages.create(t.id, role="user", content="second")
    msgs = client.beta.threads.messages.list(t.id, order="asc")
    assert [m.content[0].text.value for m in msgs.data] == ["first", "second"]
    page = client.beta.threads.messages.list(t.id, order="asc", limit=1)
    assert page.has_more and page.data[0].content[0].text.value == "first"
    after = client.beta.threads.messages.list(t.id, order="asc", after=page.data[0].id)
    assert [m.id for m in after.data] == [m2.id]
    assert client.beta.threads.messages.update(m2.id, thread_id=t.id, metadata={"a": "b"}).metadata == {"a": "b"}
    assert client.beta.threads.messages.delete(m2.id, thread_id=t.id).deleted
    assert client.beta.threads.update(t.id, metadata={"title": "y"}).metadata == {"title": "y"}
    assert client.beta.threads.delete(t.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.beta.threads.retrieve(t.id)


def test_run_create_and_poll(client):
    a = client.beta.assistants.create(model=MODEL_NAME, instructions="You answer.")
    t = client.beta.threads.create(messages=[{"role": "user", "content": "Hello"}])
    run = client.beta.threads.runs.create_and_poll(thread_id=t.id, assistant_id=a.id, poll_interval_ms=100,
                                                   max_completion_tokens=8)
    assert run.status in ("completed", "incomplete") and run.usage.completion_tokens <= 8
    msgs = client.beta.threads.messages.list(t.id, order="asc").data
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].run_id == run.id and msgs[1].content[0].text.value
    steps = client.beta.threads.runs.steps.list(run.id, thread_id=t.id).data
    assert steps[0].step_details.message_creation.message_id == msgs[1].id
    assert client.beta.threads.runs.list(t.id).data[0].id == run.id


def test_run_stream_events(client, http):
    a = client.beta.assistants.create(model=MODEL_NAME, instructions="You answer.")
    t = client.beta.threads.create(messages=[{"role": "user", "content": "Hi there"}])
    events, text = [], ""
    with client.beta.threads.runs.stream(thread_id=t.id, assistant_id=a.id, max_completion_tokens=6) as s:
        for ev in s:
            events.append(ev.event)
            if ev.event == "thread.message.delta":
                text += ev.data.delta.content[0].text.value
    assert events[0] == "thread.run.created" and events[-1] in ("thread.run.completed", "thread.run.incomplete")
    for e in ("thread.run.in_progress", "thread.message.created", "thread.message.delta", "thread.run.step.completed"):
        assert e in events
    final = client.beta.threads.messages.list(t.id, order="desc", limit=1).data[0]
    assert final.role == "assistant" and final.content[0].text.value == text
    # raw SSE ends with the done event
    body = {"assistant_id": a.id, "stream": True, "max_completion_tokens": 3,
            "thread": {"messages": [{"role": "user", "content": "x"}]}}
    with http.stream("POST", "/v1/threads/runs", json=body) as r:
        body = r.read().decode()
    assert body.startswith("event: thread.created") and body.rstrip().endswith("event: done\ndata: [DONE]")


def test_run_cancel(live_app, make_engine, tiny):
    from .test_engine import SlowGenerator, _wait
    from ktransformers.generation import Generator

    model, tok = tiny
    slow = SlowGenerator(Generator(model, tok), delay=0.05)
    with live_app(make_engine(slow)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        a = c.beta.assistants.create(model=MODEL_NAME)
        t = c.beta.threads.create(messages=[{"role": "user", "content": "go"}])
        run = c.beta.threads.runs.create(thread_id=t.id, assistant_id=a.id, max_completion_tokens=500)
        assert run.status == "queued"
        assert _wait(lambda: c.beta.threads.runs.retrieve(run.id, thread_id=t.id).status == "in_progress")
        # no new messages while the run is active
        with pytest.raises(openai.BadRequestError):
            c.beta.threads.messages.create(t.id, role="user", content="more")
        assert c.beta.threads.runs.cancel(run.id, thread_id=t.id).status == "cancelling"
        assert _wait(lambda: c.beta.threads.runs.retrieve(run.id, thread_id=t.id).status == "cancelled")
        assert slow.cancelled.is_set()
        msg = c.beta.threads.messages.list(t.id, order="desc", limit=1).data[0]
        assert msg.role == "assistant" and msg.status == "incomplete"
        # a streaming run whose client goes away is cancelled too
        with httpx.Client(base_url=srv.url, timeout=30) as h:
            with h.stream("POST", f"/v1/threads/{t.id}/runs", json={"assistant_id": a.id, "stream": True,
                                                                    "max_completion_tokens": 500}) as r:
                lines = r.iter_lines()
                while "thread.message.delta" not in next(lines):
                    pass
        assert _wait(lambda: c.beta.threads.runs.list(t.id).data[0].status == "cancelled")


def test_concurrent_writes_lose_nothing(server):
    t = httpx.post(server.url + "/v1/threads", json={}).json()
    errors = []

    def writer(i):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for j in range(5):
                r = c.post(f"/v1/threads/{t['id']}/messages", json={"role": "user", "content": f"{i}-{j}"})
                if r.status_code != 200:
                    errors.append(r.text)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    [x.start() for x in threads]
    [x.join() for x in threads]
    assert not errors
    data = httpx.get(server.url + f"/v1/threads/{t['id']}/messages", params={"limit": 100}).json()["data"]
    assert sorted(m["content"][0]["text"]["value"] for m in data) == sorted(f"{i}-{j}" for i in range(8)
                                                                            for j in range(5))


def test_data_survives_restart_and_api_key(tiny_dir, tmp_path):
    data, log = tmp_path / "data", tmp_path / "log.txt"
    auth = {"Authorization": "Bearer k3y"}
    proc, url = start_server(tiny_dir, data, log, "--api_key", "k3y")
    try:
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        a = httpx.post(url + "/v1/assistants", json={"name": "keep"}, headers=auth).json()
        t = httpx.post(url + "/v1/threads", json={"messages": [{"role": "user", "content": "remember me"}]},
                       headers=auth).json()
    finally:
        stop_server(proc)
    assert (data / "ktransformers.sqlite3").is_file() and (data / "logs" / "server.log").is_file()
    proc, url = start_server(tiny_dir, data, log)
    try:
        assert httpx.get(url + f"/v1/assistants/{a['id']}").json()["name"] == "keep"
        msgs = httpx.get(url + f"/v1/threads/{t['id']}/messages").json()["data"]
        assert msgs[0]["content"][0]["text"]["value"] == "remember me"
    finally:
        stop_server(proc)


def test_assistants_errors(http):
    r = http.post("/v1/threads/thread_nope/runs", json={"assistant_id": "asst_nope"})
    assert r.status_code == 404 and "thread" in r.json()["error"]["message"]
    r = http.post("/v1/assistants", json={"model": "gpt-4"})
    assert r.status_code == 404
    r = http.get("/v1/assistants", params={"limit": 1000})
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"]
    r = http.post("/v1/threads", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400
    json.dumps(http.get("/v1/threads").json())  # the extension list route
