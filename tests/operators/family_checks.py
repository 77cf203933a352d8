"""What the family tests (gpt-oss, Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3.2 / GLM-5, DeepSeek-V4; also
tests/generation/test_families.py and test_parity.py) share: the expert-backend swaps of a shipped
``-cpu`` rule file and their check, prompt ids, the error measure their tolerances are stated in,
the greedy checks against transformers, the rules ``load_model`` picks, the GPU rule files'
cross-device parity, our converter's F32 / Q8_0 files and the server's fallback."""

from __future__ import annotations

import torch

#: the routed-experts op of the shipped -cpu rule files
EXPERTS_CPU = "generate_op: KExpertsCPU\n      backend: llamafile"
#: backend -> (rule text to replace, its replacement, tolerance relative to max |logit|)
BACKEND_SWAPS = {
    "KExpertsTorch": (EXPERTS_CPU, "generate_op: KExpertsTorch", 1e-4),
    "AMXBF16": ("backend: llamafile", "backend: AMXBF16", 1e-2),
    "AMXInt8": ("backend: llamafile", "backend: AMXInt8", 3e-2),
}


def prompt_ids(n: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| relative to max |ref|."""
    return (got - ref).abs().max().item() / ref.abs().max().item()


def assert_greedy_equal(model, hf, ids: torch.Tensor) -> None:
    """16 greedy tokens after the prompt's first four: ours (brought to the CPU) equal transformers'
    ``generate``."""
    a = model.generate(ids[:, :4], max_new_tokens=16, do_sample=False).cpu()
    assert torch.equal(a, hf.generate(ids[:, :4], max_new_tokens=16, do_sample=False))


def load_with_picked_rules(model_dir, architecture: str, stem: str):
    """The folder's config names ``architecture``; ``default_rule_file`` picks the shipped
    ``{stem}-cpu.yaml`` (``{stem}.yaml`` where CUDA is present) and ``load_model`` places every
    module by it.  Returns (config, our model)."""
    from transformers import AutoConfig

    from ktransformers import load_model
    from ktransformers.optimize_rules import RULES_DIR, default_rule_file

    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.architectures == [architecture]
    assert default_rule_file(cfg, cuda=False) == RULES_DIR / f"{stem}-cpu.yaml"
    assert default_rule_file(cfg, cuda=True) == RULES_DIR / f"{stem}.yaml"
    return cfg, load_model(model_dir, model_path=model_dir, allow_unmatched=False)


def assert_moe_block_on_cpu_kernels(mlp, router: str, shared_linear: str | None = None,
                                    block: str = "KMoEBlock") -> None:
    """A placed sparse block: a ``block`` with a ``router`` router, its routed experts on the CPU
    kernels (llamafile) and, with ``shared_linear`` (e.g. ``shared_experts.down_proj``), that shared
    expert linear on KLinearCPU."""
    assert type(mlp).__name__ == block and type(mlp.gate).__name__ == router
    op = mlp.experts.generate_op
    assert op.name == "KExpertsCPU" and op.backend == "llamafile"
    if shared_linear is not None:
        assert mlp.get_submodule(shared_linear).generate_op.name == "KLinearCPU"


def generator_greedy(model, hf, model_dir, chunk_size: int, min_prompt: int, new_tokens: int = 16):
    """(ours, transformers') greedy continuations of one chat prompt: ours through the project's
    engine with prefill in ``chunk_size`` chunks (the state a family keeps in its cache must carry
    across them), transformers' through ``generate``."""
    from transformers import AutoTokenizer

    from ktransformers.generation import Generator, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    gen = Generator(model, tok, chunk_size=chunk_size)
    gen.eos_ids = set()
    ids = gen.apply_chat_template([{"role": "user", "content": "Hello there, how are you today?"}])
    assert len(ids) > min_prompt
    ours = [e.token_id for e in gen.stream(ids, SamplingParams(max_new_tokens=new_tokens))][:-1]
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(ids):].tolist()
    return ours, ref


def check_gpu_rules_cross_device_parity(model_dir, hf) -> None:
    """The shipped CPU+GPU rule file (``load_model`` picks it where CUDA is present): something
    placed on the GPU, logits within 1e-3 of max |logit| of transformers' and 16 greedy tokens equal."""
    from ktransformers import load_model

    model = load_model(model_dir, model_path=model_dir, allow_unmatched=False)
    assert any(p.generate_device.type == "cuda" for p in model.kt_plan.placements.values())
    ids = prompt_ids()
    with torch.no_grad():
        assert rel_err(model(ids).logits.cpu(), hf(ids).logits) <= 1e-3
    assert_greedy_equal(model, hf, ids)


def check_expert_backend(model, hf, tol: float, int8_worst: float | None = None) -> None:
    """Our model (its routed experts on some backend) against transformers on a 24-token prompt:
    every position's logits within ``tol`` of max |logit|; with ``int8_worst``, the median position
    within ``tol`` and the worst within ``int8_worst`` (int8 weights may flip a router's choice at a
    near tie).  Where ``tol`` <= 1e-4, 16 greedy tokens equal too."""
    ids = prompt_ids(24, seed=3)
    with torch.no_grad():
        got, ref = model(ids).logits[0], hf(ids).logits[0]
    per_pos = (got - ref).abs().amax(-1) / ref.abs().max()
    if int8_worst is None:
        assert per_pos.max() <= tol
    else:
        assert per_pos.median() <= tol and per_pos.max() <= int8_worst
    if tol <= 1e-4:
        assert_greedy_equal(model, hf, ids)


def our_f32_file(model_dir, hf, tmp_path, config_keys):
    """Our converter's F32 file of a tiny folder, validated, with ``config_keys`` coming back from its
    metadata alone as transformers' config has them.  Returns (path, source)."""
    from ktransformers.convert import convert
    from ktransformers.weights.gguf_source import GGUFSource

    f32 = convert(model_dir, tmp_path / "f32.gguf", "F32", "F32", "F32")
    src = GGUFSource(f32)
    src.validate()
    cfg = src.config()
    for key in config_keys:
        assert getattr(cfg, key) == getattr(hf.config, key), key
    return f32, src


def check_our_converter_f32_and_q8(model_dir, hf, tmp_path, config_keys):
    """Our converter on a tiny folder.  F32: ``config_keys`` come back from the metadata alone and the
    logits are within 1e-4 of max |logit| of transformers'.  Q8_0 through the shipped rules (the CPU
    kernels on the Q8_0 bytes, activations quantized to 8 bits) against transformers on the file's
    dequantized weights: llama.cpp's own bar (fixtures README, test_gguf_inject): mean |diff| <= 0.05,
    median per-position max <= 0.2, max <= 0.75.  Returns the F32 file's source."""
    from ktransformers import load_model
    from ktransformers.convert import convert
    from ktransformers.weights.gguf_source import GGUFSource

    f32, src = our_f32_file(model_dir, hf, tmp_path, config_keys)
    ids = prompt_ids()
    with torch.no_grad():
        ref = hf(ids).logits
        assert rel_err(load_model(f32, allow_unmatched=False)(ids).logits, ref) <= 1e-4
        q8 = convert(model_dir, tmp_path / "q8.gguf", "Q8_0", "Q8_0", "Q8_0")
        deq = hf_on_gguf(GGUFSource(q8))(ids).logits
        diff = (load_model(q8, allow_unmatched=False)(ids).logits - deq).abs()[0]
    assert diff.mean() <= 0.05 and diff.max(1).values.median() <= 0.2 and diff.max() <= 0.75
    return src


def assert_server_serves_one_at_a_time(model_dir, caplog, reason: str) -> None:
    """The server falls back from continuous batching to one request at a time, saying why."""
    from ktransformers.server.engine import Engine
    from ktransformers.server.main import build_engine, parse_settings

    with caplog.at_level("WARNING", logger="ktransformers.server"):
        engine = build_engine(parse_settings(["--model_path", str(model_dir), "--cache_lens", "512"]))
    assert type(engine) is Engine and engine.max_context == 512
    assert "continuous batching is not available for this model" in caplog.text
    assert reason in caplog.text


def hf_on_gguf(src):
    """The unmodified transformers model on a GGUF source's weights, dequantized (each tensor in
    the model's own dtype: fp32, and DeepSeek-V4's int64 hash tables)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(src.config()).eval()
    model.load_state_dict({k: src.tensor(k, dtype=v.dtype) for k, v in model.state_dict().items()}, strict=True)
    return model


def gguf_tensors(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (type, shape) of every tensor of a GGUF file: what two writers must agree on."""
    import gguf

    return {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in gguf.GGUFReader(path).tensors}


def gguf_model_keys(path) -> dict:
    """A GGUF file's metadata but the writer's own (general.*) and the vocabulary."""
    import gguf

    return {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values()
            if not f.name.startswith(("GGUF.", "general.", "tokenizer."))}


def assert_same_layout(ours, theirs, ours_only: tuple[str, ...] = ()) -> None:
    """Tensor names, ggml types and shapes equal; the reference's model keys all written with its
    values (``ours_only``: the keys only our converter writes)."""
    import pytest

    assert gguf_tensors(ours) == gguf_tensors(theirs)
    mine, ref = gguf_model_keys(ours), gguf_model_keys(theirs)
    assert set(ref) <= set(mine) and set(mine) - set(ref) == set(ours_only)
    for k, v in ref.items():
        assert mine[k] == pytest.approx(v) if isinstance(v, float) else mine[k] == v, k


def assert_converter_rewrites(fixture, tmp_path, ours_only: tuple[str, ...] = ()):
    """The HF model read back from llama.cpp's file, converted by ours (F32): the same file (names,
    types, shapes, model metadata; values equal up to the float rounding of the value transforms
    undone and redone, e.g. -exp(log(-a)) and (w - 1) + 1).  Returns that HF model."""
    import gguf
    import numpy as np

    from ktransformers.convert import convert
    from ktransformers.weights.gguf_source import GGUFSource

    model = hf_on_gguf(GGUFSource(fixture))
    model.save_pretrained(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "ours.gguf", "F32", "F32", "F32", tokenizer=False)
    assert_same_layout(out, fixture, ours_only)
    theirs = {t.name: np.array(t.data) for t in gguf.GGUFReader(fixture).tensors}
    for t in gguf.GGUFReader(out).tensors:
        np.testing.assert_allclose(np.array(t.data), theirs[t.name], rtol=1e-6, atol=1e-7, err_msg=t.name)
    return model


def assert_f16_as_llama_cpps(llama_cpp, model_dir, tmp_path, ours_only: tuple[str, ...] = ()) -> None:
    """llama.cpp's converter (tests/llama_cpp_convert.py) and ours on one model at F16: the same
    tensors, types and metadata; its file loads through the shipped rules with transformers' logits
    on its dequantized weights (1e-4 relative)."""
    import subprocess
    import sys
    from pathlib import Path

    from ktransformers import load_model
    from ktransformers.convert import convert
    from ktransformers.weights.gguf_source import GGUFSource

    theirs = tmp_path / "lcpp.gguf"
    script = Path(__file__).resolve().parents[1] / "llama_cpp_convert.py"
    r = subprocess.run([sys.executable, str(script), str(llama_cpp), str(model_dir), str(theirs), "f16"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    ours = convert(model_dir, tmp_path / "ours.gguf", "F16", "F16", "F16", tokenizer=False)
    assert_same_layout(ours, theirs, ours_only)
    ids = prompt_ids()
    with torch.no_grad():
        got = load_model(theirs, allow_unmatched=False)(ids).logits
        assert rel_err(got, hf_on_gguf(GGUFSource(theirs))(ids).logits) <= 1e-4


def model_with_backend(model_dir, rules_path, swap: tuple[str, str]):
    """Our model on a shipped ``-cpu`` rule file with the routed experts' op or backend swapped
    (``swap``: text to replace, its replacement; an empty pair keeps the file), every experts module
    checked to run the op asked for."""
    from ktransformers import load_model

    old, new = swap
    rules = rules_path.read_text()
    assert old in rules
    model = load_model(model_dir, model_path=model_dir, rules=rules.replace(old, new) if old else rules,
                       allow_unmatched=False)
    want = "KExpertsTorch" if "KExpertsTorch" in new else "KExpertsCPU"
    assert all(layer.mlp.experts.generate_op.name == want
               for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    return model
