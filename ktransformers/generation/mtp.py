"""DeepSeek-V3's multi-token-prediction (MTP) layer as a speculative drafter.

A DeepSeek-V3 / R1 checkpoint carries, after its ``num_hidden_layers`` decoder layers, a
next-token-prediction layer (``model.layers.{num_hidden_layers}.*``): ``enorm`` / ``hnorm`` (RMSNorms
of the next token's embedding and of the model's hidden state), ``eh_proj`` ([hidden, 2 hidden]),
a full decoder layer (MLA + MoE) and ``shared_head.norm``; its ``shared_head.head`` and
``embed_tokens`` are the model's own (not read).  Computed as transformers' ``MtpLayer``
(modeling_layers.py) computes it:

    h'_j = shared_head.norm(layer(eh_proj(cat(enorm(emb(t_{j+1})), hnorm(h_j))), position j + 1))
    logits = lm_head(h'_j)   -> a guess for t_{j+2}

with ``h_j`` the model's final hidden state (after its final norm) at position ``j``.  The layer keeps
its own latent cache: one entry per position whose ``h_j`` the model computed (the prompt's from
the prefill, the answer's from each decode step's rows, ``DecodeStep.last_hidden``).  A draft of
``k`` tokens chains the layer: the first guess from the model's last hidden state and the pending
token, each next one from the layer's own ``h'`` and the previous guess.  The guessed entries are
dropped before the next draft.

The drafted tokens are only guesses: the model verifies them as rows of its decode step
(``DecodeStep.step_rows``), so greedy answers are the plain ones token for token whatever the
layer guesses.  The layer runs as transformers' modules in fp32 on the CPU (weights read from the
model's weight source, ``model.kt_weights``): a real DeepSeek-V3 MTP layer (one MoE layer, ~11 B
parameters) takes ~45 GB this way; the tiny models of the tests take kilobytes.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

#: model types whose checkpoints carry DeepSeek-V3's MTP layer (``model.layers.{num_hidden_layers}``)
MTP_MODEL_TYPES = ("deepseek_v3",)


#: MtpLayer tensor -> checkpoint tensor (after ``model.layers.{n}.``); ``mtp_block.X`` is ``X``
NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
         "post_norm.weight": "shared_head.norm.weight"}


def load_mtp_layer(model):
    """The model's MTP layer as transformers' ``MtpLayer`` (fp32, CPU), built once per model; a
    one-line ``ConfigError`` when the model has none."""
    got = model.__dict__.get("_kt_mtp_layer")
    if got is not None:
        return got
    from transformers.modeling_layers import MtpLayer

    config = model.config.get_text_config()
    if getattr(config, "model_type", None) not in MTP_MODEL_TYPES:
        raise ConfigError(f"--speculative mtp: {getattr(config, 'model_type', None)} models have no MTP layer the "
                          f"drafter runs (DeepSeek-V3 / R1 checkpoints do)")
    src = getattr(model, "kt_weights", None)
    n = int(config.num_hidden_layers)
    prefix = f"model.layers.{n}."
    if src is None or not src.has(prefix + "eh_proj.weight"):
        raise ConfigError(f"--speculative mtp: the weights have no MTP layer ({prefix}eh_proj.weight not found; "
                          f"a GGUF or a checkpoint saved without layer {n} has none)")
    backbone = model.get_decoder()
    layer_cls = type(backbone.layers[-1])
    norm_cls = type(backbone.layers[-1].input_layernorm)
    cfg = config.get_mtp_config() if hasattr(config, "get_mtp_config") else config
    cfg._attn_implementation = "eager"  # the drafter passes its own causal mask
    with torch.device("meta"):
        layer = MtpLayer(cfg, layer_cls, norm_cls, 0, use_post_norm=True)
    names = NAMES
    state = {}
    for name, p in list(layer.state_dict(keep_vars=True).items()):
        ckpt = prefix + (names[name] if name in names else name.removeprefix("mtp_block."))
        if not name.startswith("mtp_block.") and name not in names:
            raise ConfigError(f"--speculative mtp: MTP layer tensor {name} has no checkpoint name")
        if not src.has(ckpt):
            raise ConfigError(f"--speculative mtp: {ckpt} not found in the weights")
        t = src.tensor(ckpt, dtype=torch.float32)
        if tuple(t.shape) != tuple(p.shape):
            raise ConfigError(f"--speculative mtp: {ckpt} is {tuple(t.shape)}, the layer needs {tuple(p.shape)}")
        state[name] = t
    layer = layer.to_empty(device="cpu")
    layer.load_state_dict(state, strict=True)
    layer.eval()
    model.__dict__["_kt_mtp_layer"] = layer
    return layer


class MTPDrafter:
    """Guesses from the model's MTP layer (see the module docstring).

    ``step``: the model's ``DecodeStep`` (it keeps each step's final hidden rows for the drafter);
    ``prompt_hidden``: the model's final hidden states of the prompt ``[n, hidden]`` (the prefill's)."""

    def __init__(self, model, step, prompt_hidden: torch.Tensor):
        from transformers import DynamicCache

        self.layer = load_mtp_layer(model)
        self.step = step
        step.keep_hidden = True
        self.embed = model.get_input_embeddings()
        self.head = model.get_output_embeddings()
        self.rotary = model.get_decoder().rotary_emb
        self.tokens: list[int] = []
        self.hidden: dict[int, torch.Tensor] = {}  # position -> the model's final hidden row, not yet in the layer
        for j, row in enumerate(prompt_hidden.float()):
            self.hidden[j] = row
        self.cache = DynamicCache()
        self.done = 0            # positions whose entry in the layer's cache is the model's (not a guess)
        self.broken = False

    def extend(self, tokens) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def append(self, token: int) -> None:
        self.tokens.append(int(token))

    def _layer(self, tokens: list[int], hidden: torch.Tensor, first: int) -> torch.Tensor:
        """The layer over inputs ``tokens`` (the tokens after positions ``first ..``) and the hidden
        rows ``hidden [T, H]`` of those positions: its normed outputs ``[T, H]`` (cache extended)."""
        T = len(tokens)
        emb = self.embed(torch.tensor([tokens], dtype=torch.long)).float()
        pos = torch.arange(first + 1, first + 1 + T).unsqueeze(0)
        pe = self.rotary(emb, pos)
        past = self.cache.get_seq_length()
        mask = None
        if T > 1:  # causal over the layer's cache (the entries before ``first``) and these rows
            keep = torch.arange(past + T)[None, :] <= (past + torch.arange(T))[:, None]
            mask = torch.zeros(T, past + T).masked_fill_(~keep, torch.finfo(torch.float32).min)[None, None]
        out = self.layer(emb, hidden[None].float(), position_embeddings=pe, attention_mask=mask, position_ids=pos,
                         cache=self.cache)
        return (out[0] if isinstance(out, tuple) else out)[0]

    def draft(self, k: int) -> list[int]:
        if self.broken:
            return []
        with torch.inference_mode():
            return self._draft(k)

    def _draft(self, k: int) -> list[int]:
        m = len(self.tokens)
        last = getattr(self.step, "last_hidden", None)
        if last is not None:  # the rows the model's latest step computed (those kept: positions <= m - 2)
            positions, rows = last
            for p, row in zip(positions, rows):
                if self.done <= p <= m - 2:
                    self.hidden[p] = row.clone()
            self.step.last_hidden = None
        extra = self.cache.get_seq_length() - self.done
        if extra > 0:
            self.cache.crop(-extra)  # the guessed entries of the last draft
        todo = list(range(self.done, m - 1))
        if any(j not in self.hidden for j in todo):
            self.broken = True  # a step not taken by the decode step (no hidden rows): plain decoding from here
            return []
        if k <= 0:
            return []  # no guess asked (the policy pauses): the positions are read in one call later
        h = None
        if todo:
            rows = torch.stack([self.hidden.pop(j) for j in todo])
            h = self._layer([self.tokens[j + 1] for j in todo], rows, todo[0])[-1:]
            self.done = m - 1
        if h is None:
            return []
        out = []
        while True:
            guess = int(self.head(h[None]).reshape(-1).float().argmax())
            out.append(guess)
            if len(out) >= k:
                return out
            h = self._layer([guess], h, m - 2 + len(out))[-1:]
