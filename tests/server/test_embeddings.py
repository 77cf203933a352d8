"""Embeddings through the official ``openai`` and ``ollama`` clients: the last token's final hidden
state, unit length on ``/v1/embeddings`` and ``/api/embed`` (raw on the legacy ``/api/embeddings``),
float and base64 wire forms, token usage, batches of strings and of token ids; ``/api/pull`` says
why this server pulls nothing."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from .conftest import MODEL_NAME

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

TEXTS = ["The three primary colors are", "A dog ran across the field", "hi"]


@pytest.fixture
def srv(live_app, make_engine):
    with live_app(make_engine(max_context=64)) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Unit vectors from the unmodified transformers model: its final hidden state at the last token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))

    def embed(text_or_ids) -> np.ndarray:
        ids = tok.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
        with torch.inference_mode():
            h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
        return h / np.linalg.norm(h)

    embed.tokenizer = tok
    embed.size = model.config.hidden_size
    return embed


def test_openai_client_float_and_base64(srv, reference):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    got = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == MODEL_NAME
    vectors = np.array([d.embedding for d in got.data])
    assert vectors.shape == (3, reference.size)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    for v, text in zip(vectors, TEXTS):
        np.testing.assert_allclose(v, reference(text), atol=2e-4)
    n = sum(len(reference.tokenizer.encode(t)) for t in TEXTS)
    assert got.usage.prompt_tokens == got.usage.total_tokens == n
    b64 = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the client asks for base64 and decodes it
    np.testing.assert_array_equal(np.array([d.embedding for d in b64.data], dtype=np.float32),
                                  vectors.astype(np.float32))
    raw = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(__import__("base64").b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, vectors[0].astype(np.float32))


def test_token_id_inputs_and_batch_independence(srv, reference):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    ids = reference.tokenizer.encode(TEXTS[0])
    one = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    many = client.embeddings.create(model=MODEL_NAME, input=[ids, ids[:3]], encoding_format="float")
    text = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float")
    assert one.data[0].embedding == many.data[0].embedding == text.data[0].embedding
    np.testing.assert_allclose(many.data[1].embedding, reference(ids[:3]), atol=2e-4)
    assert many.usage.prompt_tokens == len(ids) + 3


def test_ollama_client_embed_and_legacy_embeddings(srv, reference):
    c = ollama.Client(host=srv.url)
    got = c.embed(model=MODEL_NAME, input=TEXTS)
    vectors = np.array(got.embeddings)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    for v, text in zip(vectors, TEXTS):
        np.testing.assert_allclose(v, reference(text), atol=2e-4)
    assert got.prompt_eval_count == sum(len(reference.tokenizer.encode(t)) for t in TEXTS)
    legacy = np.array(c.embeddings(model=MODEL_NAME, prompt=TEXTS[0]).embedding)
    assert abs(np.linalg.norm(legacy) - 1) > 1e-3  # raw, as Ollama answers it
    np.testing.assert_allclose(legacy / np.linalg.norm(legacy), vectors[0], atol=1e-6)
    assert c.embeddings(model=MODEL_NAME, prompt="").embedding == []


def test_input_longer_than_the_context(srv):
    long = "word " * 400  # more than the 64 tokens of this server's context
    r = httpx.post(srv.url + "/v1/embeddings", json={"input": ["ok", long]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input[1]"
    c = ollama.Client(host=srv.url)
    assert c.embed(model=MODEL_NAME, input=long).prompt_eval_count == 64  # truncate (the default): the start
    with pytest.raises(ollama.ResponseError, match=r"prompt text is 2000 characters"):  # refused untokenized
        c.embed(model=MODEL_NAME, input=long, truncate=False)
    with pytest.raises(ollama.ResponseError, match=r"'input\[0\]' is \d+ tokens"):
        c.embed(model=MODEL_NAME, input=long[:400], truncate=False)


@pytest.mark.parametrize("body, needle", [
    ({"input": ""}, "'input': must not be empty"),
    ({"input": []}, "'input': must not be an empty list"),
    ({"input": ["a", ""]}, "'input': [1] must not be empty"),
    ({"input": ["a", [1]]}, "not a mix"),
    ({"input": [[1], []]}, "[1] must not be an empty list"),
    ({"input": [10**9]}, "outside the vocabulary"),
    ({"input": "a", "dimensions": 3}, "'dimensions'"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "model": "other"}, "does not exist"),
])
def test_openai_embeddings_bad_input_is_a_named_400(srv, body, needle):
    r = httpx.post(srv.url + "/v1/embeddings", json=body)
    assert r.status_code in (400, 404) and needle in r.json()["error"]["message"], r.text


def test_embedding_between_generation_steps(srv):
    """An embedding asked for while a generation streams waits for a step to end, and is the same."""
    alone = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS[1]}).json()["data"][0]["embedding"]
    done = {}

    def chat():
        done["chat"] = httpx.post(srv.url + "/api/generate", json={
            "model": MODEL_NAME, "prompt": "hi", "raw": True, "stream": False, "options": {"num_predict": 40}},
            timeout=120).json()

    t = threading.Thread(target=chat)
    t.start()
    during = [httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS[1]}, timeout=120).json()
              for _ in range(5)]
    t.join(120)
    assert done["chat"]["done"] and done["chat"]["eval_count"] >= 1
    assert all(d["data"][0]["embedding"] == alone for d in during)


def test_pull_names_what_this_server_does(srv):
    c = ollama.Client(host=srv.url)
    with pytest.raises(ollama.ResponseError, match="loads one model from a path") as e:
        c.pull("llama3.2")
    assert e.value.status_code == 400 and MODEL_NAME in str(e.value)
    assert c.pull(MODEL_NAME).status == "success"  # the served model: nothing to fetch
    assert [p.status for p in c.pull(MODEL_NAME, stream=True)] == ["success"]
