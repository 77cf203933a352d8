"""A bounded schemathesis run against the app, in-process, with EVERY check of the installed
schemathesis version (``--checks all``): on every operation of the app's own OpenAPI document,
generated valid and invalid requests get no 5xx, only documented status codes, content types and
headers, responses (SSE events too) that match the documented schemas, invalid data refused and
valid data accepted.

The app is the default server: the batching engine (``--backend_type balance_serve``) over a
paged KV pool with the prefix cache (RAM and disk tiers), and every route family (OpenAI,
Assistants, Responses, Conversations, Ollama, /metrics, /health).

Two things the generated requests are held to, because JSON Schema cannot say them:

* answer lengths (``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``, Ollama's
  ``num_predict``) are cut to a few tokens, so the run stays short on a CPU; a prompt + answer
  that cannot fit the context is refused with 400 ``context_length_exceeded`` (tested in
  ``test_batching_http.py`` and ``test_engine.py``);
* a body is at most half the context in JSON characters, so that its prompt fits (a longer one
  is the same 400);
* a Responses ``tool_choice`` naming a function that is not in ``tools`` (its 400 is tested in
  ``test_responses.py``) is not sent as a valid request.

``KT_FUZZ_EXAMPLES`` (``tests/fuzzing.py``) sets the examples per operation and mode (8 by default).
"""

from __future__ import annotations

import collections
import itertools
import json

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, assume, given  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

EXAMPLES_PER_OPERATION = 8
CONTEXT = 8192
ANSWER_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_ANSWER = 4


def all_checks() -> list:
    from schemathesis.checks import CHECKS, load_all_checks

    load_all_checks()
    return list(CHECKS.get_all())


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from transformers import AutoTokenizer

    from ktransformers import load_model
    from ktransformers.server import Settings, create_app
    from ktransformers.server.batch_engine import build_batch_engine
    from ktransformers.server.engine import SamplingDefaults
    from ktransformers.util.tiny_models import write_tiny_model

    base = tmp_path_factory.mktemp("schemathesis")
    write_tiny_model("qwen3_moe", base / "tiny", max_position_embeddings=CONTEXT)
    model = load_model(base / "tiny" / "model.safetensors", base / "tiny", device="cpu")
    tok = AutoTokenizer.from_pretrained(str(base / "tiny"))
    cfg = Settings(data_dir=str(base / "data"), allowed_hosts="testserver", cache_lens=CONTEXT, page_size=16,
                   max_batch_size=4, chunk_size=256, max_queue=4, prefix_cache_ram_gb=0.01,
                   prefix_cache_dir=str(base / "prefix"), prefix_cache_disk_gb=0.01)
    engine = build_batch_engine(cfg, model, tok, CONTEXT, model_name="tiny", max_queue=4,
                                defaults=SamplingDefaults(max_new_tokens=3), model_info={"family": "qwen3_moe"})
    assert type(engine).__name__ == "BatchEngine" and engine.prefix_cache is not None
    engine.start()
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", create_app(engine, cfg))
    finally:
        engine.shutdown()


def _short_answers(body) -> None:
    if not isinstance(body, dict):
        return
    for key in ANSWER_LENGTH_FIELDS:
        v = body.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_ANSWER:
            body[key] = MAX_ANSWER
    options = body.get("options")
    if isinstance(options, dict):
        v = options.get("num_predict")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_ANSWER:
            options["num_predict"] = MAX_ANSWER  # -1 / -2 keep to the server's max_new_tokens; others are a 400


def _names_an_absent_tool(case) -> bool:
    body = case.body
    if case.operation.label != "POST /v1/responses" or not isinstance(body, dict):
        return False
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return False
    fn = choice.get("function")
    name = choice.get("name") or (fn.get("name") if isinstance(fn, dict) else None)
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    return name not in [t.get("name") for t in tools if isinstance(t, dict)]


def _too_long_for_the_context(body) -> bool:
    """A body whose text may tokenize past the context (a byte-level token per byte of its JSON)."""
    return len(json.dumps(body, default=str)) > CONTEXT // 2


def test_schemathesis_every_check_finds_no_server_error_and_no_undocumented_status(api):
    checks = all_checks()
    assert {c.__name__ for c in checks} >= {"not_a_server_error", "status_code_conformance",
                                            "positive_data_acceptance", "negative_data_rejection",
                                            "response_schema_conformance", "content_type_conformance"}
    statuses: collections.Counter = collections.Counter()
    modes: collections.Counter = collections.Counter()
    nothing_to_negate: list[str] = []
    failures: list[str] = []
    operations = [op.ok() for op in api.get_all_operations()]
    labels = {op.label for op in operations}
    assert len(operations) >= 45 and {"POST /v1/responses", "POST /v1/conversations", "GET /metrics",
                                      "POST /v1/chat/completions", "POST /api/chat"} <= labels, labels
    from schemathesis import GenerationMode

    for op, mode in itertools.product(operations, GenerationMode):
        @fuzz_settings(EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                       suppress_health_check=list(HealthCheck))
        @given(op.as_strategy(generation_mode=mode))
        def run(case):
            positive = case.meta is not None and case.meta.generation.mode.is_positive
            assume(not (positive and (_names_an_absent_tool(case) or _too_long_for_the_context(case.body))))
            _short_answers(case.body)
            response = case.call_and_validate(checks=checks)
            statuses[response.status_code] += 1
            modes[case.meta.generation.mode if case.meta else None] += 1

        try:
            run()
        except Unsatisfiable:  # nothing of this operation can be made invalid (no body, no typed parameter)
            assert mode is GenerationMode.NEGATIVE, op.label
            nothing_to_negate.append(op.label)
        except (Exception, BaseExceptionGroup) as e:  # a check failed: go on, report every operation at the end
            failures.append(f"{op.label} ({mode.value}): {str(e)[:20000]}")  # the whole reproduction
    print(f"\nschemathesis: {len(operations)} operations, {sum(statuses.values())} cases "
          f"({', '.join(f'{m}: {n}' for m, n in modes.items())}), {len(checks)} checks, "
          f"statuses {dict(sorted(statuses.items()))}; {len(nothing_to_negate)} operations have nothing to make invalid")
    assert not failures, "\n\n".join(failures)
    assert sum(statuses.values()) >= 3 * len(operations) and not any(s >= 500 for s in statuses), statuses
    assert statuses[400] > 0 and statuses[200] > 0 and len(modes) == 2, (statuses, modes)
