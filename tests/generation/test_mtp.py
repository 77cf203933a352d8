"""The MTP layer of DeepSeek-V3 and GLM-4-MoE as a speculative drafter (generation/mtp.py).

A tiny DeepSeek-V3 and a tiny GLM-4-MoE checkpoint (MLA; GQA with partial rotary, q/k norms and
biases), each with a random MTP layer (``model.layers.3.*``: enorm, hnorm, eh_proj, a full MoE
decoder layer, shared_head) beside its three layers:

* greedy answers with ``speculative="mtp"`` are the plain answers token for token (the guesses are
  verified as rows of the decode step), with guesses drafted;
* the drafter's guesses are the ones transformers' own ``MtpLayer`` gives, computed independently
  (the unmodified transformers model's final hidden states, the layer's weights read straight from
  the safetensors file, the whole sequence re-run without a cache), wherever the reference's top-1
  margin exceeds 1e-4 x max|logits|;
* a model without an MTP layer is refused with one line; with the decode step off the layer is
  not loaded (one warning line says so) and decoding is plain.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ktransformers import load_model
from ktransformers.errors import ConfigError
from ktransformers.generation import Generator, SamplingParams
from ktransformers.generation.mtp import mtp_config
from ktransformers.util.tiny_models import tiny_config, write_tiny_model

from .test_invariance import _NoText

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory, family) -> Path:
    return write_mtp_checkpoint(family, tmp_path_factory.mktemp(f"{family}-mtp"))


def write_mtp_checkpoint(family: str, d: Path, own_indexer: bool = True) -> Path:
    """A tiny folder of ``family`` whose checkpoint holds a random MTP layer after its 3 decoder layers
    (GLM-5: with its own indexer, or without one)."""
    from safetensors.torch import load_file, save_file

    lists = ("layer_types", "mlp_layer_types", "indexer_types")  # per layer: the MTP layer's entry too
    four = {k: v for k, v in vars(mtp_config(tiny_config(family), own_indexer)).items()
            if k in lists and v is not None}
    write_tiny_model(family, d, seed=4, num_hidden_layers=4, **four)  # layer 3: the MTP layer's decoder layer
    sd = load_file(d / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    H = int(sd["model.embed_tokens.weight"].shape[1])
    p = "model.layers.3."
    sd[p + "enorm.weight"] = 1.0 + 0.2 * torch.randn(H, generator=g)
    sd[p + "hnorm.weight"] = 1.0 + 0.2 * torch.randn(H, generator=g)
    sd[p + "eh_proj.weight"] = 0.05 * torch.randn(H, 2 * H, generator=g)
    sd[p + "shared_head.norm.weight"] = 1.0 + 0.2 * torch.randn(H, generator=g)
    sd[p + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    cfg.update({k: v[:3] for k, v in four.items()})
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def model(mtp_dir):
    return load_model(mtp_dir, model_path=mtp_dir)


def _prompt(seed=3, n=20):
    run = [int(i) for i in np.random.default_rng(seed).integers(3, 300, n)]
    return run * 2 + run[: n // 2]


@pytest.mark.parametrize("draft_max", [1, 4])
def test_mtp_greedy_is_the_plain_answer(model, draft_max):
    g = Generator(model, _NoText(), speculative="mtp", draft_max=draft_max)
    run = model.__dict__["_kt_mtp_run"]  # the MTP layer on the step's kernels: MLA / GQA and the MoE block
    assert (run.lay.mla is not None) == (model.config.model_type == "deepseek_v3")
    assert run.lay.moe is not None and run.lay.moe.deepseek is not None
    check_mtp_greedy(model, g, _prompt())


def check_mtp_greedy(model, g, prompt) -> None:
    """``g`` (a Generator drafting with MTP) gives the plain greedy answer, guesses drafted; with a
    repetition penalty too (the verify samples each row with the history before it)."""
    params = SamplingParams(max_new_tokens=32)
    _, want, _ = Generator(model, _NoText()).generate(prompt, params)
    _, got, _ = g.generate(prompt, params)
    assert got == want
    st = g.last_stats
    assert st.drafted_tokens > 0 and st.generated_tokens - len(want) in (0, 1)  # (+ an end-of-text token)
    params = SamplingParams(max_new_tokens=24, repetition_penalty=1.3)
    _, want, _ = Generator(model, _NoText()).generate(prompt, params)
    _, got, _ = g.generate(prompt, params)
    assert got == want


def _reference_layer(mtp_dir, config):
    """transformers' MtpLayer with the checkpoint's tensors read by safetensors itself."""
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm

    cfg = config.get_mtp_config()
    cfg._attn_implementation = "eager"
    classes = {"deepseek_v3": (DeepseekV3DecoderLayer, DeepseekV3RMSNorm),
               "glm4_moe": (Glm4MoeDecoderLayer, Glm4MoeRMSNorm)}[config.model_type]
    layer = MtpLayer(cfg, *classes, 0)
    sd = load_file(mtp_dir / "model.safetensors")
    p = "model.layers.3."
    E = int(config.n_routed_experts)
    state = {"enorm.weight": sd[p + "enorm.weight"], "hnorm.weight": sd[p + "hnorm.weight"],
             "eh_proj.weight": sd[p + "eh_proj.weight"], "post_norm.weight": sd[p + "shared_head.norm.weight"]}
    ex = p + "mlp.experts."
    state["mtp_block.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([sd[f"{ex}{e}.gate_proj.weight"], sd[f"{ex}{e}.up_proj.weight"]]) for e in range(E)])
    state["mtp_block.mlp.experts.down_proj"] = torch.stack([sd[f"{ex}{e}.down_proj.weight"] for e in range(E)])
    for k, v in sd.items():
        if k.startswith(p) and not k.startswith(ex) and "shared_head" not in k and "enorm" not in k \
                and "hnorm" not in k and "eh_proj" not in k and "embed_tokens" not in k:
            state["mtp_block." + k[len(p):]] = v
    layer.load_state_dict(state, strict=True)
    return layer.eval()


def _reference_drafts(hf, layer, tokens: list[int], k: int):
    """(guesses, top-1 margins) for the text ``tokens`` (the last one pending), no cache anywhere."""
    m = len(tokens)
    with torch.no_grad():
        h = hf(torch.tensor([tokens[:m - 1]]), output_hidden_states=True).hidden_states[-1][0]  # [m - 1, H]
        inputs = list(tokens[1:])
        out, margins = [], []
        for _ in range(k):
            T = len(inputs)
            emb = hf.model.embed_tokens(torch.tensor([inputs]))
            pos = torch.arange(1, T + 1)[None]
            keep = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
            mask = torch.zeros(T, T).masked_fill_(~keep, torch.finfo(torch.float32).min)[None, None]
            hn = layer(emb, h[None], position_embeddings=hf.model.rotary_emb(emb, pos), attention_mask=mask,
                       position_ids=pos, cache=None)[0]
            logits = hf.lm_head(hn[-1])
            top2 = logits.topk(2).values
            margins.append(float((top2[0] - top2[1]) / logits.abs().max()))
            out.append(int(logits.argmax()))
            inputs.append(out[-1])
            h = torch.cat([h, hn[-1:]])
    return out, margins


@pytest.mark.parametrize("pattern", [(3,), (0, 0, 2)], ids=["every-step", "pauses"])
def test_mtp_guesses_are_transformers_mtp_layers(model, mtp_dir, monkeypatch, pattern):
    """``pauses``: steps without guesses in between, so the layer reads several positions in one
    call over its cache."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(mtp_dir, dtype=torch.float32).eval()
    check_guesses(model, hf, _reference_layer(mtp_dir, hf.config), _prompt(seed=8), pattern, 1e-4, monkeypatch)


def check_guesses(model, hf, layer, prompt, pattern, margin: float, monkeypatch) -> None:
    """The drafter's guesses over a greedy answer (``pattern``: guesses asked per step, cycled) are
    ``_reference_drafts``' wherever its top-1 margin exceeds ``margin`` x max|logits|; at least 10
    compared."""
    from ktransformers.generation.mtp import MTPDrafter
    from ktransformers.generation.speculative import Policy

    seen = []
    own = MTPDrafter.draft

    def draft(self, k):
        got = own(self, k)
        seen.append((list(self.tokens), got))
        return got

    monkeypatch.setattr(MTPDrafter, "draft", draft)
    ks = iter(pattern * 100)
    monkeypatch.setattr(Policy, "next_k", lambda self: next(ks))  # guess by the pattern, however few are kept
    g = Generator(model, _NoText(), speculative="mtp", draft_max=3)
    g.generate(prompt, SamplingParams(max_new_tokens=30))
    compared = 0
    for tokens, got in seen:
        if not got:
            continue
        want, margins = _reference_drafts(hf, layer, tokens, len(got))
        for i, (a, b) in enumerate(zip(got, want)):
            if margins[i] <= margin:
                break  # a near tie: the chains may part from here on
            assert a == b, f"after {len(tokens)} tokens, guess {i} is {a}, transformers' MTP layer gives {b}"
            compared += 1
    assert compared >= 10, f"only {compared} guesses compared"


def test_a_model_without_an_mtp_layer_is_refused(tiny):
    with pytest.raises(ConfigError, match="no MTP layer"):
        Generator(tiny("deepseek_v3"), _NoText(), speculative="mtp")
    with pytest.raises(ConfigError, match="no MTP layer"):
        Generator(tiny("llama"), _NoText(), speculative="mtp")
    with pytest.raises(ConfigError, match="deepseek_v4 models have no MTP layer"):  # mtp.* not modelled
        Generator(tiny("deepseek_v4"), _NoText(), speculative="mtp")


def test_with_the_step_off_the_layer_is_not_loaded(mtp_dir, family, monkeypatch, caplog):
    """``KT_LEAN_DECODE=0``: nothing verifies guesses, so the layer is checked, not loaded, and one
    line says why."""
    monkeypatch.setenv("KT_LEAN_DECODE", "0")
    m = load_model(mtp_dir, model_path=mtp_dir)
    with caplog.at_level("WARNING"):
        g = Generator(m, _NoText(), speculative="mtp")
        g.generate(_prompt(), SamplingParams(max_new_tokens=4))
    assert g.last_stats.drafted_tokens == 0 and "_kt_mtp_layer" not in m.__dict__
    said = [r.getMessage() for r in caplog.records if "speculative=mtp" in r.getMessage()]
    assert said == [f"speculative=mtp: {family} decodes without the one decode step (KT_LEAN_DECODE=0); "
                    "MTP layer not loaded, plain decoding"], said


def test_local_chat_with_mtp_gives_the_plain_answer(mtp_dir):
    from tests.test_local_chat import run_chat

    common = ("--model_path", mtp_dir, "--prompt", "abc abc abc abc abc", "--max_new_tokens", 24, "--stats",
              "--cpu_infer", 1, "--temperature", 0)
    plain = run_chat(*common)
    spec = run_chat(*common, "--speculative", "mtp", "--draft_max", 3)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "drafted " in spec.stderr, spec.stderr
