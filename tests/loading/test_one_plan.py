"""A load parses its rules once and makes its plan once: the load pipeline (``loading/pipeline.py``:
``plan_load`` then ``load_planned``) checks the plan on the meta model before any weight is read, and
the injection applies that same plan.  Every entry point -- ``load_model``, ``ktransformers.load``,
``load_for_generation`` (local_chat, the server), the server's ``build_engine``, fine-tuning's adapter
merge -- goes through it; the spies count the calls."""

from __future__ import annotations

import importlib

import pytest

# by module name: the package re-exports a function called ``inject`` over its submodule's name
inject_mod = importlib.import_module("ktransformers.optimize.inject")
plan_mod = importlib.import_module("ktransformers.optimize.plan")
rules_mod = importlib.import_module("ktransformers.optimize.rules")
loading = importlib.import_module("ktransformers.loading.pipeline")


@pytest.fixture
def calls(monkeypatch):
    """Counts of ``plan_model``, ``parse_rules`` and the pipeline's two halves during a test."""
    made = {"plan_model": 0, "parse_rules": 0, "plan_load": 0, "load_planned": 0}

    def spy(name, real):
        def counting(*a, **k):
            made[name] += 1
            return real(*a, **k)

        return counting

    plan = spy("plan_model", plan_mod.plan_model)
    for mod in (plan_mod, inject_mod, loading):  # wherever a caller finds it by name
        monkeypatch.setattr(mod, "plan_model", plan)
    monkeypatch.setattr(rules_mod, "parse_rules", spy("parse_rules", rules_mod.parse_rules))
    for name in ("plan_load", "load_planned"):
        monkeypatch.setattr(loading, name, spy(name, getattr(loading, name)))
    return made


def _once(calls):
    assert calls == {"plan_model": 1, "parse_rules": 1, "plan_load": 1, "load_planned": 1}, calls


def test_load_model_parses_and_plans_once(tiny_model_dir, calls):
    d = tiny_model_dir("qwen3_moe")
    model = loading.load_model(d, model_path=d)
    _once(calls)
    assert model.kt_plan is not None


def test_load_model_with_a_device_map_parses_and_plans_once(tiny_model_dir, calls):
    from ktransformers.optimize_rules import RULES_DIR

    d = tiny_model_dir("qwen3_moe")
    model = loading.load_model(d, rules=RULES_DIR / "Qwen3Moe.yaml", device="cpu", device_map="cuda=cpu")
    _once(calls)
    assert {str(x) for x in model.kt_plan.devices()} == {"cpu"}
    assert model.kt_plan.rules[0].source.endswith("Qwen3Moe.yaml")  # the file's own lines, not re-serialised


def test_load_for_generation_parses_and_plans_once(tiny_model_dir, calls):
    d = tiny_model_dir("qwen3_moe")
    loaded = loading.load_for_generation(d, model_path=d)
    _once(calls)
    assert loaded.model.kt_plan is not None


def test_top_level_load_parses_and_plans_once(tiny_model_dir, calls):
    import ktransformers

    d = tiny_model_dir("qwen3_moe")
    model, tok = ktransformers.load(d)
    _once(calls)
    assert tok is not None


def test_server_start_up_parses_and_plans_once(tiny_model_dir, calls):
    from ktransformers.server.main import build_engine, parse_settings

    d = tiny_model_dir("qwen3_moe")
    build_engine(parse_settings(["--model_path", str(d), "--backend_type", "ktransformers", "--cache_lens", "256"]))
    _once(calls)


def test_parsed_rules_are_not_parsed_again(tiny_model_dir, calls):
    from ktransformers.optimize.rules import load_rules
    from ktransformers.optimize_rules import RULES_DIR

    rules = load_rules(RULES_DIR / "Qwen3Moe-cpu.yaml")
    d = tiny_model_dir("qwen3_moe")
    model = loading.load_model(d, rules=rules, device="cpu")
    assert calls["parse_rules"] == 1 and calls["plan_model"] == 1
    assert model.kt_plan.rules == rules


def test_adapter_merge_loads_through_the_pipeline(tiny_model_dir, calls, tmp_path):
    """``sft``'s merge reads the base weights through ``load_model`` (no rules: the plain modules), then
    the adapter (here a folder that is not one: refused after the load)."""
    from ktransformers.errors import KTError
    from ktransformers.sft import adapter

    d = tiny_model_dir("qwen3_moe")
    with pytest.raises(KTError):
        adapter.merge_adapter(d, d, tmp_path / "no-adapter", tmp_path / "out")
    # an empty rule list is nothing to parse
    assert calls == {"plan_model": 1, "parse_rules": 0, "plan_load": 1, "load_planned": 1}, calls


def test_a_plan_of_another_model_is_refused(tiny_model_dir):
    from ktransformers.optimize_rules import default_rule_file

    a, b = tiny_model_dir("qwen3_moe"), tiny_model_dir("llama")
    ca, cb = loading.load_config(a, None), loading.load_config(b, None)
    rules = default_rule_file(ca, cuda=False)
    plan = plan_mod.plan_model(inject_mod.build_model(ca), rules, "cpu")
    with pytest.raises(ValueError, match="another model"):
        inject_mod.inject(inject_mod.build_model(cb), rules, b, allow_unmatched=True, plan=plan)


def test_explain_plans_once_through_the_load_pipeline(tiny_model_dir, calls, capsys):
    """``python -m ktransformers.optimize explain`` makes the plan a load makes (``plan_load``), once, and
    loads nothing: a GPU rule file on a machine without CUDA is explained, devices as written."""
    from ktransformers.optimize.__main__ import main
    from ktransformers.optimize_rules import RULES_DIR

    d = tiny_model_dir("qwen3_moe")
    assert main(["explain", str(RULES_DIR / "Qwen3Moe.yaml"), "--gguf_path", str(d)]) == 0
    assert calls == {"plan_model": 1, "parse_rules": 1, "plan_load": 1, "load_planned": 0}, calls
    out = capsys.readouterr().out
    assert "cuda:0/KLinearTorch" in out and "Weight format per tensor:" in out


def test_a_plan_made_to_be_read_is_not_loaded(tiny_model_dir):
    from ktransformers.errors import ConfigError
    from ktransformers.optimize_rules import RULES_DIR

    d = tiny_model_dir("qwen3_moe")
    planned = loading.plan_load(None, d, RULES_DIR / "Qwen3Moe.yaml", plan_only=True)  # a config alone
    assert planned.source is None and str(planned.plan.placements["model.layers.0.self_attn"].generate_device) == "cuda:0"
    with pytest.raises(ValueError, match="plan_only"):
        loading.load_planned(planned)
    with pytest.raises(ConfigError, match="no weights given"):
        loading.plan_load(None, d)
