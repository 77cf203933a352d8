"""The load report's bytes per device: what the loaded model holds, each block of memory once."""

import pytest

from ktransformers.optimize import explain_plan, plan_model
from ktransformers.optimize_rules import default_rule_file
from ktransformers.optimize.inject import build_model, inject


def _tied_tiny_gemma(tiny_model_dir, tmp_path_factory, quant):
    from ktransformers.convert import convert

    out = tmp_path_factory.mktemp("tied-load") / f"g-{quant}.gguf"
    return convert(tiny_model_dir("gemma3_text"), out, quant, quant, quant, tokenizer=False)


@pytest.mark.parametrize("quant", ["Q8_0", "F32"])
def test_tied_head_counted_once_in_load_report(tiny_model_dir, tmp_path_factory, quant):
    """A tied head that reads the embedding's bytes adds nothing of its own: the load report agrees
    with explain (the file's bytes), not the embedding twice."""
    from ktransformers.weights import open_weights
    from ktransformers.weights.model_config import load_config

    path = _tied_tiny_gemma(tiny_model_dir, tmp_path_factory, quant)
    source = open_weights(path)
    cfg = load_config(None, source)
    assert cfg.tie_word_embeddings
    rules = default_rule_file(cfg, cuda=False)
    model = build_model(cfg)
    ex = explain_plan(model, plan_model(model, rules, "cpu"), source)
    model = inject(build_model(cfg), rules, source)
    assert model.kt_load_report.bytes_per_device == ex.bytes_per_device


def test_tied_plain_head_counted_once(tiny_model_dir):
    """A tied head left as a plain module shares the embedding's tensor: its bytes count once."""
    from ktransformers.weights import open_weights
    from ktransformers.weights.model_config import load_config

    d = tiny_model_dir("gemma3_text")
    cfg = load_config(d)
    model = inject(build_model(cfg), [], open_weights(d), allow_unmatched=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    held = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    held.update({b.data_ptr(): b.numel() * b.element_size() for n, b in model.named_buffers()
                 if n.rpartition(".")[2] not in model.get_submodule(n.rpartition(".")[0])._non_persistent_buffers_set})
    assert model.kt_load_report.bytes_per_device == {"cpu": sum(held.values())}
