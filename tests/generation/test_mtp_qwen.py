"""The MTP layer of Qwen3-Next and Qwen3.5 (``mtp.*``) as a speculative drafter (generation/mtp.py).

Their models are not served by the decode step (gated-DeltaNet layers): the guesses are verified by
the model's own chunk-invariant forward (generation/verify_forward.py) and the layer runs by its
injected forward.  A tiny checkpoint of each with a random MTP layer (``mtp.fc``, the two pre-fc
norms, ``mtp.layers.0.*``: a gated full-attention MoE layer, ``mtp.norm``) beside its layers:

* greedy answers with ``speculative="mtp"`` are the plain answers token for token, with guesses
  drafted and accepted;
* the drafter's guesses are transformers' own ``MtpLayer`` over the family's decoder layer and norm
  classes (the unmodified model's final hidden states, the layer's tensors read straight from the
  safetensors file, the whole sequence re-run without a cache), wherever the reference's top-1
  margin exceeds 1e-2 x max|logits| (the model's hidden states on the kernels are within ~3e-3 of
  transformers' fp32 ones on the bf16 tiers: the prompt attention's P x V in bf16; a chained guess
  carries that on);
* a checkpoint without the layer is refused with one line naming the stored tensor.
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
from .test_mtp import check_guesses, check_mtp_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ("qwen3_next", "qwen3_5_moe_text")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    from ktransformers.operators.cpu_attention import flash_mode

    if flash_mode() is None:
        pytest.skip("no prompt flash kernel on this tier (or KT_FLASH_ATTN=0): prompts are read with sdpa")
    return request.param


def write_qwen_mtp_checkpoint(family: str, d: Path) -> Path:
    """A tiny ``family`` folder whose checkpoint holds a random MTP layer (``mtp.*``) after its layers."""
    from safetensors.torch import load_file, save_file

    cfg0 = tiny_config(family, head_dim=64)
    n = int(cfg0.num_hidden_layers)
    types = mtp_config(cfg0).layer_types  # the MTP layer's decoder layer: full attention
    extra = {"mlp_only_layers": list(getattr(cfg0, "mlp_only_layers", []) or [])} if family == "qwen3_next" else {}
    write_tiny_model(family, d, seed=4, head_dim=64, num_hidden_layers=n + 1, layer_types=types, **extra)
    sd = load_file(d / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    H = int(sd["model.embed_tokens.weight"].shape[1])
    p = f"model.layers.{n}."
    out = {k: v for k, v in sd.items() if not k.startswith(p)}
    out.update({"mtp.layers.0." + k[len(p):]: v for k, v in sd.items() if k.startswith(p)})
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # zero-centred: x * (1 + w)
        out[f"mtp.{name}.weight"] = 0.2 * torch.randn(H, generator=g)
    out["mtp.fc.weight"] = 0.05 * torch.randn(H, 2 * H, generator=g)
    save_file(out, d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = n
    cfg["layer_types"] = types[:n]
    cfg["mtp_num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory, family) -> Path:
    return write_qwen_mtp_checkpoint(family, tmp_path_factory.mktemp(f"{family}-mtp"))


@pytest.fixture(scope="module")
def model(mtp_dir):
    return load_model(mtp_dir, model_path=mtp_dir)


def _prompt(seed=3, n=20):
    run = [int(i) for i in np.random.default_rng(seed).integers(3, 250, n)]
    return run * 2 + run[: n // 2]


@pytest.mark.parametrize("draft_max", [1, 4])
def test_mtp_greedy_is_the_plain_answer(model, draft_max):
    check_mtp_greedy(model, Generator(model, _NoText(), speculative="mtp", draft_max=draft_max), _prompt())
    # the hook that keeps the model's hidden rows is gone after each request
    assert not model.get_decoder().norm._forward_hooks


def _reference_layer(mtp_dir, config):
    """transformers' MtpLayer over the family's decoder layer (full attention) and norm classes,
    with the checkpoint's ``mtp.*`` tensors read by safetensors itself."""
    import copy

    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpLayer

    if config.model_type == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer as L
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm as N
    else:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer as L
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm as N
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers, cfg.layer_types, cfg._attn_implementation = 1, ["full_attention"], "eager"
    if hasattr(cfg, "mlp_only_layers"):
        cfg.mlp_only_layers = []
    layer = MtpLayer(cfg, L, N, 0)
    sd = load_file(mtp_dir / "model.safetensors")
    state = {"enorm.weight": sd["mtp.pre_fc_norm_embedding.weight"],
             "hnorm.weight": sd["mtp.pre_fc_norm_hidden.weight"], "eh_proj.weight": sd["mtp.fc.weight"],
             "post_norm.weight": sd["mtp.norm.weight"]}
    p, ex = "mtp.layers.0.", "mtp.layers.0.mlp.experts."
    E = int(config.num_experts)
    if f"{ex}0.gate_proj.weight" in sd:  # per-expert tensors
        state["mtp_block.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{ex}{e}.gate_proj.weight"], sd[f"{ex}{e}.up_proj.weight"]]) for e in range(E)])
        state["mtp_block.mlp.experts.down_proj"] = torch.stack([sd[f"{ex}{e}.down_proj.weight"] for e in range(E)])
    for k, v in sd.items():
        if k.startswith(p) and not (k.startswith(ex) and k[len(ex)].isdigit()):
            state["mtp_block." + k[len(p):]] = v
    layer.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return layer.eval()


@pytest.mark.parametrize("pattern", [(3,), (0, 0, 2)], ids=["every-step", "pauses"])
def test_mtp_guesses_are_transformers_mtp_layers(model, mtp_dir, monkeypatch, pattern):
    """``pauses``: forwards without guesses in between, so the layer reads several positions in one
    call over its cache.  Margin 1e-2: see the module docstring."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(mtp_dir, dtype=torch.float32).eval()
    check_guesses(model, hf, _reference_layer(mtp_dir, hf.config), _prompt(seed=8), pattern, 1e-2, monkeypatch)


def test_a_checkpoint_without_the_layer_is_refused(tiny):
    with pytest.raises(ConfigError, match=r"no MTP layer .*'mtp\.fc\.weight'"):
        Generator(tiny("qwen3_next", head_dim=64), _NoText(), speculative="mtp")


def test_local_chat_with_mtp_gives_the_plain_answer(mtp_dir):
    from .test_mtp import test_local_chat_with_mtp_gives_the_plain_answer as same_check

    same_check(mtp_dir)


@pytest.mark.parametrize("drop", ["mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"])
def test_a_checkpoint_with_part_of_the_layer_names_the_missing_tensor(mtp_dir, tmp_path, drop):
    import shutil

    from safetensors.torch import load_file, save_file

    from ktransformers.errors import WeightError

    d = tmp_path / "partial"
    shutil.copytree(mtp_dir, d)
    sd = load_file(d / "model.safetensors")
    del sd[drop]
    save_file(sd, d / "model.safetensors")
    m = load_model(d, model_path=d)
    with pytest.raises(WeightError, match=f"MTP layer is incomplete: .*'{drop}'"):
        Generator(m, _NoText(), speculative="mtp")


def test_fuzz_any_part_of_the_layer_missing_is_named(mtp_dir, tmp_path_factory):
    """Any non-empty set of the ``mtp.*`` tensors left out of the checkpoint: one line, naming the
    first missing own tensor (MTP_TENSORS' order), or with all four gone "no MTP layer", or else
    one of the decoder layer's missing tensors (a gap in its per-expert tensors: the checkpoint is
    refused at load, naming the experts); never a traceback or a silently partial layer."""
    import shutil

    from hypothesis import HealthCheck, given
    from hypothesis import strategies as st
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ktransformers.errors import WeightError
    from ktransformers.generation.mtp import MTP_TENSORS, QWEN_MTP
    from tests.fuzzing import fuzz_settings

    with safe_open(str(mtp_dir / "model.safetensors"), "pt") as f:
        layer = sorted(k for k in f.keys() if k.startswith("mtp."))
    order = [QWEN_MTP[t] for t in MTP_TENSORS]

    @fuzz_settings(6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sets(st.sampled_from(layer), min_size=1, max_size=4))
    def check(drop):
        d = tmp_path_factory.mktemp("fuzz")
        shutil.copytree(mtp_dir, d, dirs_exist_ok=True)
        sd = {k: v for k, v in load_file(mtp_dir / "model.safetensors").items() if k not in drop}
        save_file(sd, d / "model.safetensors")
        with pytest.raises((ConfigError, WeightError)) as got:
            m = load_model(d, model_path=d)
            Generator(m, _NoText(), speculative="mtp")
        kind, msg = got.type, str(got.value)
        if "are incomplete" in msg:  # a gap in the stacked experts: the checkpoint itself is refused at load
            assert kind is WeightError and "'mtp.layers.0.mlp.experts'" in msg and "\n" not in msg, msg
            assert any(".mlp.experts." in n for n in drop), msg
            return
        assert "\n" not in msg, msg
        gone = [n for n in order if n in drop]
        if len(gone) == len(order):
            assert kind is ConfigError and "no MTP layer" in msg, msg
        elif gone:
            assert kind is WeightError and f"'{gone[0]}'" in msg, msg
        else:
            assert kind is WeightError and any(f"'{n}'" in msg for n in drop), msg

    check()
