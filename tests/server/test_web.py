"""The /web chat page in headless Chromium (system package; no browser download)."""

from __future__ import annotations

import shutil

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def page(server):
    if not CHROMIUM:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            pg = browser.new_page()
            errors = []
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.errors = errors
            yield pg
        finally:
            browser.close()


def test_web_static_files(http):
    r = http.get("/web/")
    assert r.status_code == 200 and "<textarea" in r.text
    for f in ("app.js", "markdown.js", "style.css"):
        assert http.get("/web/" + f).status_code == 200
    assert "cdn" not in r.text.lower()


def test_web_chat_streams_an_answer(page, server):
    page.goto(server.url + "/web")
    page.wait_for_selector("body[data-ready='1']", timeout=20000)
    assert page.is_hidden("#attach")  # a text model: /api/show lists no "vision"
    page.fill("#input", "Hello **there**")
    page.click("#send")
    page.wait_for_selector(".msg.user", timeout=10000)
    assert "there" in page.inner_html(".msg.user .body") and "<strong>" in page.inner_html(".msg.user .body")
    page.wait_for_selector(".msg.assistant.done", timeout=30000)
    answer = page.inner_text(".msg.assistant .body")
    assert answer.strip()
    assert page.is_hidden("#stop")
    # the conversation is an Assistants thread listed in the sidebar, and stored on the server
    page.wait_for_selector("#threads li", timeout=10000)
    threads = httpx.get(server.url + "/v1/threads").json()["data"]
    assert threads[0]["metadata"]["title"] == "Hello **there**"
    msgs = httpx.get(server.url + f"/v1/threads/{threads[0]['id']}/messages", params={"order": "asc"}).json()["data"]
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    # reopening the conversation renders it from the API
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    page.click("#threads li >> nth=0")
    page.wait_for_selector(".msg.assistant", timeout=10000)
    assert page.locator(".msg").count() == 2
    assert not page.errors
