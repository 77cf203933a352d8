"""Conversations API through the official ``openai`` client; persistence across a restart."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MODEL_NAME, start_server, stop_server

openai = pytest.importorskip("openai")
if not hasattr(openai.OpenAI, "conversations"):  # pragma: no cover - older clients
    pytest.skip("this openai client has no Conversations API", allow_module_level=True)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_conversation_crud_and_items(client):
    c = client.conversations.create(metadata={"topic": "demo"},
                                    items=[{"type": "message", "role": "user", "content": "first"}])
    assert c.id.startswith("conv_") and c.object == "conversation" and c.metadata == {"topic": "demo"}
    assert client.conversations.retrieve(c.id).id == c.id
    assert client.conversations.update(c.id, metadata={"topic": "x"}).metadata == {"topic": "x"}
    added = client.conversations.items.create(c.id, items=[
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "second"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "third"}]}])
    assert len(added.data) == 2
    texts = [i.content[0].text for i in client.conversations.items.list(c.id, order="asc")]
    assert texts == ["first", "second", "third"]
    page = client.conversations.items.list(c.id, limit=1)  # newest first by default
    assert page.data[0].content[0].text == "third" and page.has_more
    assert [i.content[0].text for i in client.conversations.items.list(c.id, limit=2).iter_pages().__next__()
            .data] == ["third", "second"]
    one = client.conversations.items.retrieve(added.data[0].id, conversation_id=c.id)
    assert one.role == "assistant"
    assert client.conversations.items.delete(added.data[0].id, conversation_id=c.id).id == c.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(added.data[0].id, conversation_id=c.id)
    assert client.conversations.delete(c.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(c.id)


def test_response_appends_to_conversation(client):
    c = client.conversations.create()
    r1 = client.responses.create(model=MODEL_NAME, input="Hello there", conversation=c.id, max_output_tokens=4)
    assert r1.conversation.id == c.id
    r2 = client.responses.create(model=MODEL_NAME, input="And again", conversation={"id": c.id},
                                 max_output_tokens=4)
    items = list(client.conversations.items.list(c.id, order="asc"))
    assert [(i.type, getattr(i, "role", None)) for i in items] == [("message", "user"), ("message", "assistant")] * 2
    assert items[1].content[0].text == r1.output_text and items[3].content[0].text == r2.output_text
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens  # history was in the prompt


@pytest.mark.parametrize("meta", [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513},
                                  {"k": 1}])
def test_metadata_limits(http, meta):
    for method, path in (("POST", "/v1/conversations"),):
        r = http.request(method, path, json={"metadata": meta})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "metadata" and r.json()["error"]["type"] == "invalid_request_error"
    c = http.post("/v1/conversations", json={}).json()
    r = http.post(f"/v1/conversations/{c['id']}", json={"metadata": meta})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"


def test_conversation_errors(http):
    c = http.post("/v1/conversations", json={}).json()
    for method, path, body in (("GET", "/v1/conversations/conv_nope", None),
                               ("GET", f"/v1/conversations/{c['id']}/items/msg_nope", None),
                               ("POST", "/v1/conversations/conv_nope/items", {"items": [{"role": "user",
                                                                                        "content": "x"}]})):
        r = http.request(method, path, json=body)
        assert r.status_code == 404 and r.json()["error"]["message"]
    r = http.post(f"/v1/conversations/{c['id']}/items", json={"items": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "items"
    r = http.post(f"/v1/conversations/{c['id']}/items", json={"items": [{"type": "computer_call"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "items[0].type"
    r = http.get(f"/v1/conversations/{c['id']}/items", params={"limit": 101})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_conversations_and_responses_survive_restart(tiny_dir, tmp_path):
    data, log = tmp_path / "data", tmp_path / "log.txt"
    proc, url = start_server(tiny_dir, data, log)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        conv = c.conversations.create(metadata={"k": "v"})
        r = c.responses.create(model=MODEL_NAME, input="remember me", conversation=conv.id, max_output_tokens=3)
    finally:
        proc.kill()  # no clean shutdown: what was answered must be on disk
        proc.wait(10)
    proc, url = start_server(tiny_dir, data, log)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert c.conversations.retrieve(conv.id).metadata == {"k": "v"}
        items = list(c.conversations.items.list(conv.id, order="asc"))
        assert items[0].content[0].text == "remember me" and items[1].content[0].text == r.output_text
        assert c.responses.retrieve(r.id).output_text == r.output_text
        r2 = c.responses.create(model=MODEL_NAME, input="next", conversation=conv.id, max_output_tokens=3)
        assert r2.usage.input_tokens > r.usage.input_tokens
        assert httpx.get(url + f"/v1/responses/{r.id}/input_items").json()["data"][0]["content"][0]["text"] == \
            "remember me"
    finally:
        stop_server(proc)


def test_unfinished_response_marked_incomplete(tmp_path):
    from ktransformers.server.db import Database
    from ktransformers.server.responses_store import ResponseRow, expire_unfinished_responses

    db = Database(tmp_path)
    with db.write() as s:
        s.add(ResponseRow(id="resp_cut", created_at=0, status="in_progress", data={
            "id": "resp_cut", "status": "in_progress",
            "output": [{"type": "message", "id": "msg_1", "status": "in_progress", "content": []}]}, input_items=[]))
    db.close()
    db = Database(tmp_path)  # the next server process: the row's writer is gone
    assert expire_unfinished_responses(db) == 1
    with db.read() as s:
        row = s.query(ResponseRow).one()
        assert row.status == "incomplete" and row.data["output"][0]["status"] == "incomplete"
        assert row.data["incomplete_details"] == {"reason": "interrupted"}
    assert expire_unfinished_responses(db) == 0
