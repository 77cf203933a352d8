"""context_length_exceeded suggests a larger --cache_lens only where the model's own context allows one."""

from __future__ import annotations

import pytest

from ktransformers.server.engine import GenerationRequest, PromptTooLong


def test_prompt_too_long_names_the_models_limit_at_it(make_engine, tiny):
    model, _ = tiny
    limit = int(model.config.max_position_embeddings)
    engine = make_engine(max_context=limit)
    with pytest.raises(PromptTooLong) as e:
        engine.make_params(GenerationRequest(list(range(limit))))
    assert "--cache_lens" not in e.value.message and "the model's own limit" in e.value.message, e.value.message
    with pytest.raises(PromptTooLong) as e:
        engine.make_params(GenerationRequest([1] * (limit - 4), max_new_tokens=10))
    assert "--cache_lens" not in e.value.message and "ask for at most 4 tokens" in e.value.message


def test_prompt_too_long_below_the_models_limit_suggests_cache_lens(make_engine, tiny):
    model, _ = tiny
    small = int(model.config.max_position_embeddings) // 2
    engine = make_engine(max_context=small)
    with pytest.raises(PromptTooLong) as e:
        engine.make_params(GenerationRequest([1] * small))
    assert e.value.message.endswith("shorten the prompt or restart with a larger --cache_lens"), e.value.message
