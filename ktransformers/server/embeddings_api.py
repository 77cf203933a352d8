"""Embeddings: OpenAI ``POST /v1/embeddings``, Ollama ``POST /api/embed`` and Ollama's legacy
``POST /api/embeddings``.

**Pooling: the last token.** An input's vector is the model's final hidden state (after its last
norm) at the input's last token. The served models are decoders: under causal attention only the
last position has read the whole input, so it is the one summary of all of it (a mean would
average positions that each saw only a prefix); decoder embedding models (E5-Mistral, GTE-Qwen,
Qwen3-Embedding) pool the same way. A generative model was not trained for retrieval: its vectors
rank texts in its own terms, not as a trained embedding model's would.

**Normalised** to unit length (L2) on ``/v1/embeddings`` (OpenAI's vectors are; clients take the
dot product as the cosine) and on ``/api/embed`` (Ollama normalises there); the legacy
``/api/embeddings`` answers the raw vector, as Ollama does. Each input is one forward of its own,
so its vector does not depend on the other inputs of the request; forwards run between the
engine's generation steps.
"""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from .common import check_model
from .engine import Engine
from .errors import APIError
from .schemas import EmbeddingRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest

openai_router = APIRouter()
ollama_router = APIRouter()


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _check_dimensions(engine: Engine, dimensions: int | None) -> None:
    size = engine.embedding_size
    if dimensions is not None and dimensions != size:
        raise APIError(400, f"'dimensions': this model's embeddings have {size} dimensions (its hidden size) "
                            f"and no shorter form (got {dimensions})", param="dimensions")


def token_ids(engine: Engine, inputs: list, *, truncate: bool) -> list[list[int]]:
    """Token ids of each input: text as the tokenizer makes them for a prompt (its BOS setting), ids as
    given. An input longer than the context is cut to its start with ``truncate``, else a 400."""
    out = []
    for i, item in enumerate(inputs):
        where = f"input[{i}]"
        if isinstance(item, str):
            if truncate and engine.max_prompt_chars and len(item) > engine.max_prompt_chars:
                item = item[:engine.max_prompt_chars]  # more text than the context holds in any case
            engine.check_prompt_chars(len(item), where)
            ids = engine.encode(item)
        else:
            ids = engine.check_token_ids(item, where)
        if not ids:
            raise APIError(400, f"'{where}' has no tokens to embed", param=where)
        if len(ids) > engine.max_context:
            if not truncate:
                raise APIError(400, f"'{where}' is {len(ids)} tokens but this server's context holds "
                                    f"{engine.max_context} tokens (--cache_lens)", param=where,
                               code="context_length_exceeded")
            ids = ids[:engine.max_context]
        out.append(ids)
    return out


async def _vectors(engine: Engine, ids: list[list[int]]) -> list[np.ndarray]:
    return [(await run_in_threadpool(engine.embed, x)).numpy() for x in ids]


def unit(v: np.ndarray) -> np.ndarray:
    """``v`` scaled to length 1 (a zero vector stays zero)."""
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def _encoded(v: np.ndarray, encoding_format: str):
    """OpenAI's wire forms: a list of floats, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]


@openai_router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    engine = _engine(request)
    model = check_model(engine, body.model)
    _check_dimensions(engine, body.dimensions)
    inp = body.input
    items = [inp] if isinstance(inp, str) or isinstance(inp[0], int) else list(inp)
    ids = await run_in_threadpool(token_ids, engine, items, truncate=False)
    vectors = await _vectors(engine, ids)
    n = sum(len(x) for x in ids)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(unit(v), body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}


@ollama_router.post("/embed")
async def embed(body: OllamaEmbedRequest, request: Request):
    t0 = time.perf_counter()
    engine = _engine(request)
    model = check_model(engine, body.model, ollama=True)
    _check_dimensions(engine, body.dimensions)
    items = [body.input] if isinstance(body.input, str) else list(body.input)
    ids = await run_in_threadpool(token_ids, engine, items, truncate=body.truncate)
    vectors = await _vectors(engine, ids)
    return {"model": model, "embeddings": [[float(x) for x in unit(v)] for v in vectors],
            "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
            "prompt_eval_count": sum(len(x) for x in ids)}


@ollama_router.post("/embeddings")
async def embeddings_legacy(body: OllamaEmbeddingsRequest, request: Request):
    """Ollama's first embeddings route: one ``prompt``, the vector unnormalised; '' gives []."""
    engine = _engine(request)
    check_model(engine, body.model, ollama=True)
    if not body.prompt:
        return {"embedding": []}
    ids = await run_in_threadpool(token_ids, engine, [body.prompt], truncate=True)
    (vector,) = await _vectors(engine, ids)
    return {"embedding": [float(x) for x in vector]}
