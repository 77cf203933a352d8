"""Images through the server (a subprocess of the tiny Qwen3-VL-MoE): the official ``openai`` and
``ollama`` clients send a picture and get the tokens transformers' generate() gives for the same
prompt on the unmodified model; usage counts the image tokens; bad images are 400s naming why."""

from __future__ import annotations

import base64

import pytest
import torch

from server.conftest import start_server, stop_server

from .conftest import photo_like
from .vl_checks import QUESTION, png

MAX_TOKENS = 8


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module", params=["balance_serve", "ktransformers"])
def vl_server(request, tiny_vl, tmp_path_factory):
    """The server on each backend: the batching engine (the default, here with the prefix cache on)
    and the single-request engine."""
    base = tmp_path_factory.mktemp("vl-server")
    extra = ["--prefix_cache_ram_gb", "0.05"] if request.param == "balance_serve" else []
    proc, url = start_server(tiny_vl, base / "data", base / "server.log", "--model_name", "tiny-vl", "--web",
                             "--backend_type", request.param, "--max_images", "2", "--max_image_pixels", "100000",
                             *extra)
    yield url
    stop_server(proc)
    batching = "batching: " in (base / "server.log").read_text()
    assert batching == (request.param == "balance_serve")


@pytest.fixture(scope="module")
def reference(tiny_vl):
    """``reference(messages, images)``: (prompt tokens, greedy text, image tokens) of transformers'
    generate() on the unmodified model, for the prompt the server renders: each picture's markup
    then a newline before the text, through the chat template and the processor."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from ktransformers.multimodal.chat import image_support

    tok = AutoTokenizer.from_pretrained(tiny_vl)
    support = image_support(AutoConfig.from_pretrained(tiny_vl), tok, tiny_vl)
    hf = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()

    def answer(messages, images):
        msgs = [dict(m, content=m["content"].replace("<image>", support.markup)) for m in messages]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        prompt = support.prompt(text, images)
        inputs = {"input_ids": torch.tensor([list(prompt)]), **prompt.vision.inputs}
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id)
        return len(prompt), tok.decode(out[0, len(prompt):], skip_special_tokens=True), prompt.vision.image_tokens

    return answer


@pytest.fixture(scope="module")
def expected(reference):
    n_prompt, text, n_image = reference([{"role": "user", "content": f"<image>\n{QUESTION}"}], [photo_like()])
    assert text.strip()
    return n_prompt, text, n_image


def test_openai_client_image_url(vl_server, expected):
    import openai

    n_prompt, text, n_image = expected
    client = openai.OpenAI(base_url=vl_server + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny-vl", temperature=0, max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(png(photo_like()))}},
                                     {"type": "text", "text": QUESTION}]}])
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == n_prompt and n_image > 0
    assert n_prompt > n_image  # the image's tokens and the text's


def test_ollama_client_images(vl_server, expected):
    import ollama

    n_prompt, text, _ = expected
    client = ollama.Client(host=vl_server, timeout=60)
    r = client.chat(model="tiny-vl", options={"temperature": 0, "num_predict": MAX_TOKENS},
                    messages=[{"role": "user", "content": QUESTION, "images": [png(photo_like())]}])
    assert r.message.content == text and r.prompt_eval_count == n_prompt
    g = client.generate(model="tiny-vl", prompt=QUESTION, images=[png(photo_like())],
                        options={"temperature": 0, "num_predict": MAX_TOKENS})
    assert g.response == text


@pytest.mark.parametrize("url, why", [
    (_data_url(png(photo_like())[:200]), "corrupt or truncated"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode(), "not an image"),
    ("https://example.com/cat.png", "remote URLs are not fetched"),
    ("file:///etc/hostname", "file:// URLs are off"),
    (_data_url(png(photo_like(400, 300))), "over the limit of 100000 .--max_image_pixels"),
    (_data_url(png(photo_like(1000, 1))), r"the model's processor refused them: absolute aspect ratio"),
])
def test_openai_bad_images_are_400s(vl_server, url, why):
    import openai

    client = openai.OpenAI(base_url=vl_server + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match=why):
        client.chat.completions.create(model="tiny-vl", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, "hi"]}])


def test_image_count_limit_and_ollama_bad_base64(vl_server):
    import ollama

    client = ollama.Client(host=vl_server, timeout=60)
    with pytest.raises(ollama.ResponseError, match=r"more than 2 images in one request .--max_images") as e:
        client.chat(model="tiny-vl", messages=[{"role": "user", "content": "hi", "images": [png(photo_like())] * 3}])
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="not valid base64") as e:
        client.chat(model="tiny-vl", messages=[{"role": "user", "content": "hi", "images": ["***"]}])
    assert e.value.status_code == 400


def test_responses_input_image_and_continuation(vl_server, expected, reference):
    """A Responses ``input_image`` part answers as the chat route does; the stored input keeps the
    picture, so a ``previous_response_id`` continuation sends it again with the history."""
    import openai

    n_prompt, text, _ = expected
    client = openai.OpenAI(base_url=vl_server + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.responses.create(model="tiny-vl", temperature=0, max_output_tokens=MAX_TOKENS, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": _data_url(png(photo_like()))},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert r.output_text == text and r.usage.input_tokens == n_prompt
    stored = client.responses.input_items.list(r.id).data[0].content
    assert [p.type for p in stored] == ["input_image", "input_text"]
    assert stored[0].image_url == _data_url(png(photo_like()))
    follow = "And the colours?"
    r2 = client.responses.create(model="tiny-vl", temperature=0, max_output_tokens=MAX_TOKENS,
                                 previous_response_id=r.id, input=follow)
    want = reference([{"role": "user", "content": f"<image>\n{QUESTION}"}, {"role": "assistant", "content": text},
                      {"role": "user", "content": follow}], [photo_like()])
    assert (r2.usage.input_tokens, r2.output_text) == want[:2]


def test_conversation_items_keep_the_picture(vl_server, expected):
    """A conversation created with an ``input_image`` item: a response in it reads the picture."""
    import openai

    _, text, _ = expected
    client = openai.OpenAI(base_url=vl_server + "/v1", api_key="unused", max_retries=0, timeout=60)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": _data_url(png(photo_like()))}, {"type": "input_text", "text": QUESTION}]}])
    items = client.conversations.items.list(conv.id).data
    assert [p.type for p in items[0].content] == ["input_image", "input_text"]
    # no new input: the conversation's items alone are the prompt
    r = client.responses.create(model="tiny-vl", temperature=0, max_output_tokens=MAX_TOKENS, conversation=conv.id,
                                input=[])
    assert r.output_text == text


@pytest.mark.parametrize("part, why", [
    ({"type": "input_image", "image_url": "https://example.com/cat.png"},
     r"input\[0\]\.content\[0\]\.image_url: remote URLs are not fetched"),
    ({"type": "input_image", "file_id": "file-abc"}, r"input\[0\]\.content\[0\]\.file_id: this server stores no files"),
    ({"type": "input_image", "image_url": _data_url(png(photo_like())[:200])}, "corrupt or truncated"),
])
def test_responses_bad_images_are_400s(vl_server, part, why):
    import openai

    client = openai.OpenAI(base_url=vl_server + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match=why):
        client.responses.create(model="tiny-vl", max_output_tokens=2, input=[
            {"role": "user", "content": [part, {"type": "input_text", "text": "hi"}]}])
    with pytest.raises(openai.BadRequestError, match=r"more than 2 images in one request .--max_images"):
        client.responses.create(model="tiny-vl", max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": _data_url(png(photo_like()))}] * 3}])


def test_assistants_image_url_message_and_run(vl_server, expected):
    """A thread message's ``image_url`` part is checked and stored; the run reads the picture."""
    import httpx

    _, text, _ = expected
    with httpx.Client(base_url=vl_server + "/v1", timeout=60) as c:
        a = c.post("/assistants", json={"model": "tiny-vl"}).json()
        t = c.post("/threads").json()
        m = c.post(f"/threads/{t['id']}/messages", json={"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(png(photo_like()))}},
            {"type": "text", "text": QUESTION}]})
        assert m.status_code == 200, m.text
        assert [p["type"] for p in m.json()["content"]] == ["image_url", "text"]
        run = c.post(f"/threads/{t['id']}/runs", json={"assistant_id": a["id"], "max_completion_tokens": MAX_TOKENS,
                                                       "temperature": 0})
        for _ in range(300):
            r = c.get(f"/threads/{t['id']}/runs/{run.json()['id']}").json()
            if r["status"] not in ("queued", "in_progress"):
                break
            import time

            time.sleep(0.1)
        assert r["status"] in ("completed", "incomplete"), r
        msgs = c.get(f"/threads/{t['id']}/messages", params={"order": "asc"}).json()["data"]
        assert msgs[-1]["content"][0]["text"]["value"] == text
        bad = c.post(f"/threads/{t['id']}/messages", json={"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]})
        assert bad.status_code == 400 and "content[0].image_url: remote URLs are not fetched" in bad.text


def test_web_page_offers_images_when_the_model_takes_them(vl_server):
    """The info endpoint says so (Ollama's ``vision`` capability) and the page has the control."""
    import httpx

    caps = httpx.post(vl_server + "/api/show", json={"model": "tiny-vl"}).json()["capabilities"]
    assert "vision" in caps
    page = httpx.get(vl_server + "/web/").text
    assert 'id="attach"' in page and 'type="file"' in page
    assert "image_url" in httpx.get(vl_server + "/web/app.js").text


CHROMIUM = __import__("shutil").which("chromium") or __import__("shutil").which("chromium-browser")


def test_web_page_sends_an_attached_image(vl_server, tmp_path):
    """In headless Chromium: attach a picture, send a question; the page shows the picture and an
    answer, and the thread stores the picture as the file's own bytes (its answer is checked against
    transformers in test_assistants_image_url_message_and_run)."""
    if not CHROMIUM:
        pytest.skip("chromium is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    import httpx

    path = tmp_path / "photo.png"
    path.write_bytes(png(photo_like()))
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            pg = browser.new_page()
            errors = []
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.goto(vl_server + "/web")
            pg.wait_for_selector("body[data-ready='1']", timeout=20000)
            assert pg.is_visible("#attach")
            pg.set_input_files("#image-file", str(path))
            pg.wait_for_function("document.getElementById('attached').textContent.includes('1 image')")
            pg.fill("#input", QUESTION)
            pg.click("#send")
            pg.wait_for_selector(".msg.user img.attached", timeout=10000)
            pg.wait_for_selector(".msg.assistant.done", timeout=60000)
            assert not errors
            assert pg.inner_text("#attached") == ""
        finally:
            browser.close()
    threads = httpx.get(vl_server + "/v1/threads").json()["data"]
    msgs = httpx.get(vl_server + f"/v1/threads/{threads[0]['id']}/messages", params={"order": "asc"}).json()["data"]
    assert [p["type"] for p in msgs[0]["content"]] == ["image_url", "text"]
    assert msgs[0]["content"][0]["image_url"]["url"] == _data_url(png(photo_like()))
