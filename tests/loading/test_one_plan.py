"""A load makes its plan once: the load pipeline checks the plan on the meta model before any
weight is read, and the injection applies that same plan (it is not built a second time)."""

from __future__ import annotations

import importlib

import pytest

# by module name: the package re-exports a function called ``inject`` over its submodule's name
inject_mod = importlib.import_module("ktransformers.optimize.inject")
plan_mod = importlib.import_module("ktransformers.optimize.plan")
loading = importlib.import_module("ktransformers.loading.pipeline")


@pytest.fixture
def plans(monkeypatch):
    made = []
    real = plan_mod.plan_model

    def counting(*a, **k):
        made.append(1)
        return real(*a, **k)

    for mod in (plan_mod, inject_mod, loading):
        monkeypatch.setattr(mod, "plan_model", counting)
    return made


def test_load_model_plans_once(tiny_model_dir, plans):
    d = tiny_model_dir("qwen3_moe")
    loading.load_model(d, model_path=d)
    assert len(plans) == 1


def test_load_for_generation_plans_once(tiny_model_dir, plans):
    d = tiny_model_dir("qwen3_moe")
    loaded = loading.load_for_generation(d, model_path=d)
    assert len(plans) == 1
    assert loaded.model.kt_plan is not None


def test_a_plan_of_another_model_is_refused(tiny_model_dir):
    from ktransformers.optimize_rules import default_rule_file

    a, b = tiny_model_dir("qwen3_moe"), tiny_model_dir("llama")
    ca, cb = loading.load_config(a, None), loading.load_config(b, None)
    rules = default_rule_file(ca, cuda=False)
    plan = plan_mod.plan_model(inject_mod.build_model(ca), rules, "cpu")
    with pytest.raises(ValueError, match="another model"):
        inject_mod.inject(inject_mod.build_model(cb), rules, b, allow_unmatched=True, plan=plan)
