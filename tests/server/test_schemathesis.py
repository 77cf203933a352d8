"""A bounded schemathesis run against the app, in-process: on every operation of its own OpenAPI
document, generated valid and invalid requests get no 5xx, only documented status codes and
content types, and responses that match the documented schemas.

``positive_data_acceptance`` is left out: some schema-valid bodies are refused for reasons a JSON
Schema cannot state (a prompt longer than the context, an empty prompt, a list cursor that is not
an id, ``/api/show`` needing ``model`` or ``name``), each with its documented 400.
"""

from __future__ import annotations

import collections

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

EXAMPLES_PER_OPERATION = 6


@pytest.fixture
def api(tiny, tmp_path):
    from ktransformers.generation import Generator
    from ktransformers.server import Settings, create_app
    from ktransformers.server.engine import Engine, SamplingDefaults

    model, tok = tiny
    engine = Engine(Generator(model, tok, max_cache_len=256), tok, model_name="tiny", max_context=256,
                    max_queue=4, defaults=SamplingDefaults(max_new_tokens=3), model_info={"family": "qwen3_moe"})
    engine.start()
    app = create_app(engine, Settings(data_dir=str(tmp_path / "data"), allowed_hosts="testserver"))
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", app)
    finally:
        engine.shutdown()


def test_schemathesis_finds_no_server_error_and_no_undocumented_status(api):
    statuses: collections.Counter = collections.Counter()
    failures: list[str] = []
    operations = [op.ok() for op in api.get_all_operations()]
    assert len(operations) >= 35
    for op in operations:
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(op.as_strategy())
        def run(case):
            response = case.call_and_validate(excluded_checks=[schemathesis.checks.positive_data_acceptance])
            statuses[response.status_code] += 1

        try:
            run()
        except Exception as e:  # a check failed: keep going, report every operation at the end
            failures.append(f"{op.label}: {str(e)[:600]}")
    assert not failures, "\n\n".join(failures)
    assert sum(statuses.values()) >= 150 and not any(s >= 500 for s in statuses), statuses
