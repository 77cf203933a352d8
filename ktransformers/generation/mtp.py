"""The multi-token-prediction (MTP) layer (DeepSeek-V3, GLM-4-MoE, Qwen3-Next, Qwen3.5) as a drafter.

A DeepSeek-V3 / R1 or GLM-4.5 / 4.6 / 4.7 checkpoint carries, after its ``num_hidden_layers``
decoder layers, a next-token-prediction layer (``model.layers.{num_hidden_layers}.*``): ``enorm`` /
``hnorm`` (RMSNorms of the next token's embedding and of the model's hidden state), ``eh_proj``
([hidden, 2 hidden]), a full decoder layer (DeepSeek: MLA + MoE; GLM: GQA with partial rotary +
MoE) and ``shared_head.norm``; its ``shared_head.head`` and ``embed_tokens`` are the model's own
(not read).  A GGUF holds it where llama.cpp's converter keeps it (GLM-4-MoE, GLM-5; DeepSeek-V3's
it drops): as the last block, ``blk.{n}.*`` and ``blk.{n}.nextn.*``, served under the same names
(weights/gguf_names.py).  Computed as transformers' ``MtpLayer``
(modeling_layers.py) computes it:

    h'_j = shared_head.norm(layer(eh_proj(cat(enorm(emb(t_{j+1})), hnorm(h_j))), position j + 1))
    logits = lm_head(h'_j)   -> a guess for t_{j+2}

with ``h_j`` the model's final hidden state (after its final norm) at position ``j``.

The layer is injected with the model's own rules (DeepSeek's attention ``KDeepseekV2Attention``,
the experts on ``KExpertsCPU``, the linears ``eh_proj`` included on ``KLinearCPU``; weights read from
the model's weight source, ``model.kt_weights``) and run by the decode step's own layer code
(decode_step.py: ``_Layer`` -- the MLA or GQA attention and the MoE of the step on the kernels --
the norms in C++, the model's embedding rows and ``lm_head``).  It keeps its own cache (MLA: the
latent and rope key; GQA: keys and values, read by ``decode_ops.attend_rows`` as a cache layer):
one entry per position whose ``h_j`` the model computed (the prompt's from the prefill, the answer's from each decode
step's rows, ``DecodeStep.last_hidden``).  A draft of ``k`` tokens chains the layer: the first guess
from the model's last hidden state and the pending token, each next one from the layer's own
``h'`` and the previous guess.  The guessed entries are dropped before the next draft.

Qwen3-Next and Qwen3.5-MoE keep the same layer as ``mtp.*`` (``fc``, ``pre_fc_norm_embedding`` /
``pre_fc_norm_hidden``, ``layers.0``: gated full attention and MoE, ``norm``; transformers' model
drops it at load), read here under the names above (``QWEN_MTP``).  The decode step does not serve
their models (gated-DeltaNet layers), so the layer runs by its injected forward over a dynamic cache
of its own (``_ForwardMTPLayer``), the model's hidden rows come from a hook on its final norm
(``HiddenTap``) and the model's own forward verifies the guesses (verify_forward.py).

The drafted tokens are only guesses: the model verifies them as rows of its decode step
(``DecodeStep.step_rows``), so greedy answers are the plain ones token for token whatever the
layer guesses.
"""

from __future__ import annotations

import copy
import logging

import torch

from ..errors import ConfigError, WeightError
from ..weights.source import WeightSource

log = logging.getLogger(__name__)

#: model types whose checkpoints carry an MTP layer (``model.layers.{num_hidden_layers}``) the drafter
#: reads (DeepSeek-V3.2 / GLM-5: checked, not loaded: the decode step, which verifies the guesses,
#: does not serve their sparse-attention indexer; ``check_mtp_layer``); Qwen3-Next / Qwen3.5 keep it
#: as ``mtp.*`` (``QWEN_MTP``)
MTP_MODEL_TYPES = ("deepseek_v3", "glm4_moe", "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe_text")
#: the MTP layer's own tensors (beside its decoder layer's), under ``model.layers.{num_hidden_layers}.``
MTP_TENSORS = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")
#: Qwen3-Next / Qwen3.5: the same layer stored as ``mtp.*`` (its decoder layer ``mtp.layers.0.*``, a
#: full-attention MoE layer) -> the names it is built under here (``model.layers.{n}.*``)
QWEN_MTP = {"eh_proj.weight": "mtp.fc.weight", "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
            "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "shared_head.norm.weight": "mtp.norm.weight"}
QWEN_TYPES = ("qwen3_next", "qwen3_5_moe_text")


def has_own_indexer(names, n: int) -> bool:
    """Whether HF ``names`` hold any tensor of layer ``n``'s sparse-attention indexer (GLM-5's MTP
    layer runs its own where the weights hold one, else it is a "shared" layer: ``mtp_config``)."""
    p = f"model.layers.{n}.self_attn.indexer."
    return any(x.startswith(p) for x in names)


def mtp_config(config, own_indexer: bool = True):
    """A copy of ``config`` with the MTP layer as one more layer (``num_hidden_layers + 1``; the
    per-layer lists DeepSeek-V3.2 / GLM-5 configs validate against it extended by its entry: a MoE
    block, the last layer's attention kind, its own indexer or, without one, GLM-5's "shared")."""
    cfg = copy.deepcopy(config)
    n = int(cfg.num_hidden_layers)
    cfg.num_hidden_layers = n + 1
    kind = {"mlp_layer_types": "sparse", "indexer_types": "full" if own_indexer else "shared"}
    if getattr(cfg, "model_type", None) in QWEN_TYPES:
        kind["layer_types"] = "full_attention"  # Qwen3-Next / Qwen3.5's MTP layer: gated full attention
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        got = getattr(cfg, key, None)
        if isinstance(got, list) and len(got) == n:
            setattr(cfg, key, [*got, kind.get(key, got[-1])])
    return cfg


def load_mtp_layer(model):
    """The model's MTP layer, injected with the model's own rules and loaded from its weights
    (``model.layers.{n}`` of a one-layer copy of the model), built once per model; a one-line
    ``ConfigError`` when the model has none, a ``WeightError`` naming the first missing tensor when
    the weights hold part of one."""
    got = model.__dict__.get("_kt_mtp_layer")
    if got is not None:
        return got[1]
    from torch import nn

    from ..optimize.inject import inject

    src, one, n = _mtp_block(model)
    plan = model.kt_plan
    config = model.config.get_text_config()
    layer = one.model.layers[n]
    norm_cls, H, eps = type(layer.input_layernorm), int(config.hidden_size), float(config.rms_norm_eps)
    with torch.device("meta"):
        layer.enorm, layer.hnorm = norm_cls(H, eps=eps), norm_cls(H, eps=eps)
        layer.eh_proj = nn.Linear(2 * H, H, bias=False)
        layer.shared_head = nn.Module()
        layer.shared_head.norm = norm_cls(H, eps=eps)
    one.model.layers = nn.ModuleDict({str(n): layer})
    one.model.embed_tokens = one.model.norm = one.lm_head = None  # the model's own
    try:
        inject(one, plan.rules, src, allow_unmatched=True)
    except WeightError as e:  # the decoder layer's own tensors (blk.{n}.attn_*, ffn_* of a GGUF)
        raise WeightError(f"--speculative mtp: the MTP layer is incomplete: {e}") from None
    layer = one.model.layers[str(n)]
    model.__dict__["_kt_mtp_layer"] = (one, layer)
    return layer


class _QwenMtpNames(WeightSource):
    """A weight source that serves Qwen3-Next / Qwen3.5's ``mtp.*`` tensors under the names the MTP
    layer is built with here (``model.layers.{n}.*``); every other name as the source has it."""

    def __init__(self, src, n: int):
        self._src, self._prefix, self.path = src, f"model.layers.{n}.", getattr(src, "path", "")

    def _stored(self, name: str) -> str:
        if not name.startswith(self._prefix):
            return name
        rest = name[len(self._prefix):]
        return QWEN_MTP.get(rest, "mtp.layers.0." + rest)

    def _has_native(self, name):
        return self._src._has_native(self._stored(name))

    def _load_native(self, name):
        return self._src._load_native(self._stored(name))

    def _native_shape(self, name):
        return self._src._native_shape(self._stored(name))

    def _natural_dtype(self, name):
        return self._src._natural_dtype(self._stored(name))

    def _load_as(self, name, dtype, device):
        return self._src._load_as(self._stored(name), dtype, device)

    def _load_into(self, name, out):
        self._src._load_into(self._stored(name), out)

    def names(self):
        return self._src.names()

    def raw(self, name):
        return self._src.raw(self._stored(name))

    def config(self):
        return self._src.config()

    def stores_parameter(self, name):
        return self._src.stores_parameter(self._stored(name))

    def stored_name(self, name):
        return self._src.stored_name(self._stored(name))

    def missing(self, name, hint: str = ""):
        return self._src.missing(self._stored(name), hint)


def _weights_of(model, src, n: int):
    """The source the MTP layer ``n`` is read from (a Qwen3-Next / Qwen3.5 checkpoint: its ``mtp.*``
    names; a GGUF keeps the block as ``blk.{n}.*`` / ``blk.{n}.nextn.*``, served under the layer's)."""
    mt = getattr(model.config.get_text_config(), "model_type", None)
    if mt in QWEN_TYPES and not src.has(f"model.layers.{n}.{MTP_TENSORS[0]}"):
        return _QwenMtpNames(src, n)
    return src


def _mtp_block(model):
    """``(weight source, the model as one more layer on the meta device, n)`` after the checks that
    read no tensor: an MTP model type, weights holding ``model.layers.{n}``'s own tensors (a one-line
    ``ConfigError`` when none, a ``WeightError`` naming the first missing one)."""
    from ..optimize.inject import build_model

    config = model.config.get_text_config()
    if getattr(config, "model_type", None) not in MTP_MODEL_TYPES:
        raise ConfigError(f"--speculative mtp: {getattr(config, 'model_type', None)} models have no MTP layer the "
                          f"drafter reads (DeepSeek-V3 / R1 / V3.2, GLM-4.5 / 4.6 / 4.7 / 5 checkpoints do)")
    src, plan = getattr(model, "kt_weights", None), getattr(model, "kt_plan", None)
    n = int(config.num_hidden_layers)
    prefix = f"model.layers.{n}."
    if src is None or plan is None:
        raise ConfigError("--speculative mtp: the model has no MTP layer to read (it was not loaded from weights)")
    mt = getattr(config, "model_type", None)
    if mt in QWEN_TYPES and src.stored_name("model.embed_tokens.weight") != "model.embed_tokens.weight":
        raise ConfigError(f"--speculative mtp: {mt} from a GGUF: its MTP block (blk.{n}.nextn.*, where llama.cpp's "
                          f"converter keeps it) is not read; load the safetensors checkpoint (mtp.*) to draft with it")
    src = _weights_of(model, src, n)
    have = [src.has(prefix + t) for t in MTP_TENSORS]
    if not any(have):
        raise ConfigError(f"--speculative mtp: the weights have no MTP layer ({getattr(src, 'path', '')} holds no "
                          f"'{src.stored_name(prefix + MTP_TENSORS[0])}': saved or converted without its MTP "
                          f"layer; llama.cpp's converter drops DeepSeek-V3's)")
    for t, ok in zip(MTP_TENSORS, have):
        if not ok:
            raise WeightError(f"--speculative mtp: the MTP layer is incomplete: {src.missing(prefix + t)}")
    # on the meta device: only layer n is kept, injected and loaded
    return src, build_model(mtp_config(model.config, has_own_indexer(src.names(), n))), n


def check_mtp_layer(model) -> None:
    """The checks of ``load_mtp_layer`` without reading a tensor (for a model whose decode step is
    not there to verify guesses: the layer is not loaded): the same one-line errors, the decoder
    layer's missing tensors named by their stored names too."""
    src, one, n = _mtp_block(model)
    prefix = f"model.layers.{n}."
    for name, _ in one.named_parameters():
        if name.startswith(prefix) and not src.has(name):
            raise WeightError(f"--speculative mtp: the MTP layer is incomplete: {src.missing(name)}")


#: why the decode step does not serve a model type that has an MTP layer
NOT_STEPPED = {"deepseek_v32": "its sparse-attention indexer is not served",
               "glm_moe_dsa": "its sparse-attention indexer is not served"}


def mtp_plain_notice(model, why: str | None = None) -> str:
    """The one line said (once per model, on the ``ktransformers.generation.mtp`` logger) when
    ``speculative="mtp"`` decodes plainly because the model has no decode step to verify guesses."""
    mt = getattr(model.config.get_text_config(), "model_type", None)
    line = (f"speculative=mtp: {mt} decodes without the one decode step ({why or NOT_STEPPED.get(mt, 'not served')}); "
            f"MTP layer not loaded, plain decoding")
    if not model.__dict__.get("_kt_mtp_plain_said"):
        model.__dict__["_kt_mtp_plain_said"] = True
        log.warning("%s", line)
    return line


class _MTPLayer:
    """The injected MTP layer run by the decode step's code over ``T`` rows (see the module
    docstring), with its cache: entry ``j`` is position ``j + 1``'s."""

    def __init__(self, model, step):
        from .decode_step import Unsupported, _Layer, _norm_weight, _Proj

        layer = load_mtp_layer(model)
        n = int(model.config.get_text_config().num_hidden_layers)
        try:
            self.lay = _Layer(layer, n, model.config.get_text_config(), False)
            self.eh = _Proj([layer.eh_proj])
        except Unsupported as e:
            raise ConfigError(f"--speculative mtp: the MTP layer is not on the decode step's kernels ({e})") from None
        lay = self.lay
        if (lay.mla is None) != (not step.mla):
            raise ConfigError("--speculative mtp: the MTP layer's attention is not the model's kind (MLA / GQA)")
        if lay.mla is None:
            if lay.window:
                raise ConfigError("--speculative mtp: the MTP layer has a sliding window")
            try:
                lay.partial_rotary(step._rope_width[lay.layer_type])
            except (KeyError, Unsupported) as e:
                raise ConfigError(f"--speculative mtp: the MTP layer's rotary ({e})") from None
        self.enorm, self.hnorm = _norm_weight(layer.enorm, False), _norm_weight(layer.hnorm, False)
        self.post = _norm_weight(layer.shared_head.norm, False)
        self.step, self.ops, self.H = step, step._ops, step.hidden
        if lay.mla is not None:
            m = lay.mla
            self.lat, self.rk = torch.zeros(256, m.C), torch.zeros(256, m.rope)
        else:  # keys / values [1, kv heads, entries, d], as a static cache layer holds them
            self.lat, self.rk = torch.zeros(1, lay.hkv, 256, lay.d), torch.zeros(1, lay.hkv, 256, lay.d)
        self._at = torch.zeros(2, dtype=torch.int64)  # a row's position and first position (attend_rows)

    def _room(self, entries: int) -> None:
        axis = 0 if self.lay.mla is not None else 2
        have = self.lat.shape[axis]
        if entries > have:
            cap = max(entries, 2 * have)
            grown = []
            for t in (self.lat, self.rk):
                shape = list(t.shape)
                shape[axis] = cap
                g = torch.zeros(shape)
                g.narrow(axis, 0, have).copy_(t)
                grown.append(g)
            self.lat, self.rk = grown

    def _gqa(self, T: int, h1: torch.Tensor, first: int, a: torch.Tensor) -> None:
        """The GQA attention of the rows ``h1`` at positions ``first + 1 ..`` into ``a``: q/k/v on the
        kernels, RoPE (partial: ``_Layer.rope_rows``), then each row's keys / values written into
        entry ``first + r`` and its query over entries ``0 .. first + r`` (positions 1 ..), one
        ``attend_rows`` call per row, in order."""
        lay, step, ops = self.lay, self.step, self.ops
        q = lay.qkv.rows(T, h1, torch.empty(T, lay.qkv.out_features))
        cos, sin = step._rope(h1[:1][None], torch.arange(first + 1, first + 1 + T)[None], lay.layer_type)
        cos, sin = cos.reshape(T, -1).float().contiguous(), sin.reshape(T, -1).float().contiguous()
        cp, sp = lay.rope_rows(T, q, cos, sin, ops)
        o = torch.empty(T, lay.hq * lay.d)
        cap, at = self.lat.shape[2], self._at
        qw, cw, ow = 4 * lay.qkv.out_features, 4 * lay.d, 4 * lay.hq * lay.d
        from .decode_step import _NO_ROWS

        for r in range(T):
            at[0], at[1] = first + 1 + r, 1
            ops.attend_rows(step._cpuinfer, q.data_ptr() + r * qw, 1, lay.hq, lay.hkv, lay.d, lay.qk_ptr,
                            lay.qk_eps, cp + r * cw, sp + r * cw, self.lat.data_ptr(), self.rk.data_ptr(), lay.d,
                            cap * lay.d, 0, _NO_ROWS.data_ptr(), _NO_ROWS.data_ptr(), at.data_ptr(),
                            at.data_ptr() + 8, 0, cap, 0, lay.scaling, o.data_ptr() + r * ow)
        lay.o.rows(T, o, a)

    def __call__(self, tokens: list[int], hidden: torch.Tensor, first: int) -> torch.Tensor:
        """The layer's normed outputs ``[T, H]`` for inputs ``tokens`` (the tokens after positions
        ``first ..``) and the model's hidden rows ``hidden [T, H]`` of those positions; entries
        ``first ..`` of the cache written (those after them are dropped)."""
        T, H, ops, step, lay = len(tokens), self.H, self.ops, self.step, self.lay
        self._room(first + T)
        hidden = hidden.float().contiguous()
        with step._lock:  # the step's buffers (embedding rows, the attention's)
            x = torch.empty(T, H)
            step._embed(tokens, x)
            cat = torch.empty(T, 2 * H)
            xp, hp, cp = x.data_ptr(), hidden.data_ptr(), cat.data_ptr()
            for r in range(T):
                ops.rms_norm(xp + 4 * r * H, self.enorm[2], cp + 8 * r * H, 1, H, 0, self.enorm[1])
                ops.rms_norm(hp + 4 * r * H, self.hnorm[2], cp + 4 * (2 * r + 1) * H, 1, H, 0, self.hnorm[1])
            x0 = self.eh.rows(T, cat, torch.empty(T, H))
            h1 = torch.empty(T, H)
            ops.rms_norm(x0.data_ptr(), lay.in_norm[2], h1.data_ptr(), T, H, 0, lay.in_norm[1])
            a = torch.empty(T, H)
            if lay.mla is None:
                self._gqa(T, h1, first, a)
            else:
                pe = [step.rotary(x0[:1][None], torch.tensor([[first + 1 + r]], dtype=torch.long)) for r in range(T)]
                lat, rk = self.lat, self.rk

                def kv(idx, r, c_kv, k_pe):
                    e = first + r
                    lat[e].copy_(c_kv.reshape(-1))
                    rk[e].copy_(k_pe.reshape(-1))
                    return lat[: e + 1], rk[: e + 1], None, 0, e + 1

                lay.mla(T, h1, pe, kv, a, step.mla_bufs, ops)
            h2 = torch.empty(T, H)
            ops.residual_norm(x0.data_ptr(), a.data_ptr(), 0, 0.0, lay.pre_mlp_norm[2], lay.pre_mlp_norm[1],
                              h2.data_ptr(), T, H)
            if lay.moe is not None:
                m = lay.moe(T, h2)
            elif lay.mlp_module is None:
                m = lay.down.rows(T, lay.gate_up.rows(T, h2, torch.empty(T, lay.gate_up.out_features)),
                                  torch.empty(T, H))
            else:
                m = lay.mlp_module(h2.view(1, T, H))
                m = (m[0] if isinstance(m, tuple) else m).reshape(T, H).float().contiguous()
            out = torch.empty(T, H)
            ops.residual_norm(x0.data_ptr(), m.data_ptr(), 0, 0.0, self.post[2], self.post[1], out.data_ptr(), T, H)
            return out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The model's ``lm_head`` of one normed row ``h [1, H]`` (on the kernels)."""
        with self.step._lock:
            return self.step.head.rows(1, h.contiguous(), torch.empty(1, self.step.head.out_features))


class _ForwardMTPLayer:
    """The injected MTP layer run by its own forward (Qwen3-Next / Qwen3.5, whose model the decode
    step does not serve; the layer's attention, MoE and norms are the modules the rules put there),
    with the same calls as ``_MTPLayer`` and a dynamic cache of its own: entry ``j`` is position
    ``j + 1``'s."""

    step = None

    def __init__(self, model):
        from transformers import DynamicCache

        self.layer = load_mtp_layer(model)
        self.one = model.__dict__["_kt_mtp_layer"][0]
        self.model = model
        self.n = int(model.config.get_text_config().num_hidden_layers)
        self.cache = DynamicCache()

    def _keep(self, entries: int) -> None:
        """Drop the cache entries from ``entries`` on (guesses of an earlier draft)."""
        layers = self.cache.layers
        if len(layers) > self.n:
            extra = layers[self.n].get_seq_length() - entries
            if extra > 0:
                layers[self.n].crop(-extra)

    def __call__(self, tokens: list[int], hidden: torch.Tensor, first: int) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        model, layer, T = self.model, self.layer, len(tokens)
        emb = model.get_input_embeddings()
        x = emb(torch.tensor([tokens], dtype=torch.long))
        self.dtype = x.dtype  # the model's activations (the head's input)
        h = layer.eh_proj(torch.cat([layer.enorm(x), layer.hnorm(hidden.to(x.dtype)[None])], dim=-1))
        self._keep(first)
        while len(self.cache.layers) <= self.n:  # (the layers before this one stay empty)
            self.cache.layers.append(self.cache.layer_class_to_replicate())
        pos = torch.arange(first + 1, first + 1 + T).unsqueeze(0)
        pe = model.get_decoder().rotary_emb(h, pos)
        mask = create_causal_mask(config=self.one.config, inputs_embeds=h, attention_mask=None, cache=self.cache,
                                  position_ids=pos, layer_idx=self.n)
        out = layer(h, position_embeddings=pe, attention_mask=mask, position_ids=pos, cache=self.cache)
        out = out[0] if isinstance(out, tuple) else out
        return layer.shared_head.norm(out)[0].float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The model's ``lm_head`` of one normed row ``h [1, H]``."""
        return self.model.get_output_embeddings()(h.to(self.dtype)[None])[0].float()


def mtp_runner(model, step):
    """The model's MTP layer on ``step``'s kernels (``step`` None: by its own forward, for a model
    the step does not serve), built once per model (``ConfigError`` when the model has no MTP layer
    or the layer is not on the kernels)."""
    run = model.__dict__.get("_kt_mtp_run")
    if run is None or run.step is not step:
        run = model.__dict__["_kt_mtp_run"] = _ForwardMTPLayer(model) if step is None else _MTPLayer(model, step)
    return run


class HiddenTap:
    """The final hidden rows (after the model's final norm) of each forward of a model without a
    decode step, as the step keeps them for the MTP drafter: ``last_hidden`` = (positions, rows),
    set by ``took(first)`` after a forward whose rows start at position ``first``."""

    keep_hidden = True

    def __init__(self, model):
        self.last_hidden = None
        self._rows: list[torch.Tensor] = []
        self._hook = model.get_decoder().norm.register_forward_hook(
            lambda mod, args, out: self._rows.append(out[0].detach().float()))

    def took(self, first: int) -> None:
        if self._rows:
            rows = torch.cat(self._rows)
            self._rows = []
            self.last_hidden = (range(first, first + rows.shape[0]), rows)

    def close(self) -> None:
        self._hook.remove()


class MTPDrafter:
    """Guesses from the model's MTP layer (see the module docstring).

    ``step``: the model's ``DecodeStep`` (it keeps each step's final hidden rows for the drafter), or
    None for a model the step does not serve (a ``HiddenTap`` keeps them; the caller says where each
    forward's rows start with ``took`` and ends the request with ``close``);
    ``prompt_hidden``: the model's final hidden states of the prompt ``[n, hidden]`` (the prefill's)."""

    def __init__(self, model, step, prompt_hidden: torch.Tensor):
        self.layer = mtp_runner(model, step)
        if step is None:  # a model without the decode step: its forwards' rows from a hook
            step = self.tap = HiddenTap(model)
        self.step = step
        step.keep_hidden = True
        step.last_hidden = None  # rows of an earlier request
        self.tokens: list[int] = []
        self.hidden: dict[int, torch.Tensor] = {}  # position -> the model's final hidden row, not yet in the layer
        for j, row in enumerate(prompt_hidden.float()):
            self.hidden[j] = row
        self.done = 0            # cache entries that are the model's (not guesses)
        self.broken = False

    def extend(self, tokens) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def append(self, token: int) -> None:
        self.tokens.append(int(token))

    def took(self, first: int) -> None:
        """The model's latest forward read rows from position ``first`` (models without the step)."""
        if self.step is not self.layer.step:
            self.step.took(first)

    def close(self) -> None:
        if self.step is not self.layer.step:
            self.step.close()

    def draft(self, k: int) -> list[int]:
        if self.broken:
            return []
        with torch.inference_mode():
            return self._draft(k)

    def _draft(self, k: int) -> list[int]:
        m = len(self.tokens)
        last = self.step.last_hidden
        if last is not None:  # the rows the model's latest step computed (those kept: positions <= m - 2)
            positions, rows = last
            for p, row in zip(positions, rows):
                if self.done <= p <= m - 2:
                    self.hidden[p] = row.clone()
            self.step.last_hidden = None
        todo = list(range(self.done, m - 1))
        if any(j not in self.hidden for j in todo):
            self.broken = True  # a step not taken by the decode step (no hidden rows): plain decoding from here
            return []
        if k <= 0 or not todo:
            return []  # no guess asked (the policy pauses): the positions are read in one call later
        rows = torch.stack([self.hidden.pop(j) for j in todo])
        h = self.layer([self.tokens[j + 1] for j in todo], rows, todo[0])[-1:]
        self.done = m - 1
        out = []
        while True:
            out.append(int(self.layer.logits(h).argmax()))
            if len(out) >= k:
                return out
            h = self.layer([out[-1]], h, m - 2 + len(out))
