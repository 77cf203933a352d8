"""The prefix cache on real K/V: pages of an injected tiny Qwen3-MoE (CPU experts) are cached,
spilled through RAM and disk, and a later prompt sharing the prefix prefills only its new tokens
and gets the cold run's logits (fp32 tolerance), also after a restart from the disk tier."""

from __future__ import annotations

import random

import torch
from transformers import DynamicCache

from ktransformers.server.prefix_cache import PrefixCache, model_fingerprint

from .prefix_fakes import FakePool, release

PS = 8


def _kv_shape(model):
    cfg = model.config
    heads = cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, heads, dim


def forward(model, ids: list[int], start: int, cache: DynamicCache) -> torch.Tensor:
    pos = torch.arange(start, start + len(ids)).unsqueeze(0)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), cache=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


class Sequence:
    """What a paged runner does, with a DynamicCache as the attention's view of the pages."""

    def __init__(self, model, pool: FakePool, cache: PrefixCache):
        self.model, self.pool, self.cache = model, pool, cache
        self.forwarded = 0  # tokens run through the model

    def run(self, tokens: list[int]):
        pages, n, tiers = self.cache.match(tokens)
        kv = DynamicCache()
        layers = self.pool.layers
        if n:
            st = self.pool.storage[pages]                    # [pages, layers, 2, PS, heads, dim]
            for layer in range(layers):
                k = st[:, layer, 0].reshape(n, *st.shape[-2:]).transpose(0, 1).unsqueeze(0)
                v = st[:, layer, 1].reshape(n, *st.shape[-2:]).transpose(0, 1).unsqueeze(0)
                kv.update(k.clone(), v.clone(), layer)
        logits = forward(self.model, tokens[n:], n, kv)
        self.forwarded += len(tokens) - n
        seq = list(pages)
        for pos in range(n, len(tokens)):                  # write the new K/V into pool pages
            if pos // PS >= len(seq):
                seq.append(self.pool.alloc())
            for layer in range(layers):
                self.pool.storage[seq[pos // PS], layer, 0, pos % PS] = kv.layers[layer].keys[0, :, pos]
                self.pool.storage[seq[pos // PS], layer, 1, pos % PS] = kv.layers[layer].values[0, :, pos]
        self.cache.insert(tokens, seq)
        release(self.pool, seq)
        return logits, n, tiers


def test_shared_prefix_prefills_only_new_tokens_with_cold_logits(tiny, tiny_dir, tmp_path):
    model, _ = tiny
    layers, heads, dim = _kv_shape(model)
    fp = model_fingerprint(model, tiny_dir / "model.safetensors", cache_dtype=torch.float32)
    r = random.Random(0)
    vocab = model.config.vocab_size
    system = [r.randrange(3, vocab) for _ in range(37)]
    q1, q2, q3 = ([r.randrange(3, vocab) for _ in range(n)] for n in (9, 6, 11))

    def cold(tokens):
        return forward(model, tokens, 0, DynamicCache())

    pool = FakePool(64, PS, layers=layers, heads=heads, dim=dim)
    cache = PrefixCache(pool, fingerprint=fp, page_size=PS, ram_bytes=2 ** 30, disk_dir=tmp_path, disk_bytes=2 ** 30)
    s = Sequence(model, pool, cache)
    logits, n, _ = s.run(system + q1)
    assert n == 0 and s.forwarded == 46
    torch.testing.assert_close(logits, cold(system + q1), rtol=1e-5, atol=1e-5)

    logits, n, tiers = s.run(system + q2)           # device tier: 4 full pages of the system prompt
    assert n == 32 and tiers == {"device": 4, "ram": 0, "disk": 0}
    assert s.forwarded == 46 + (43 - 32)            # only the new tokens were prefilled
    torch.testing.assert_close(logits, cold(system + q2), rtol=1e-5, atol=1e-5)

    cache.clear_device()                            # RAM tier
    logits, n, tiers = s.run(system + q3)
    assert n == 32 and tiers == {"device": 0, "ram": 4, "disk": 0}
    torch.testing.assert_close(logits, cold(system + q3), rtol=1e-5, atol=1e-5)
    cache.close()

    pool2 = FakePool(64, PS, layers=layers, heads=heads, dim=dim)   # restart: disk tier
    cache2 = PrefixCache(pool2, fingerprint=fp, page_size=PS, disk_dir=tmp_path, disk_bytes=2 ** 30)
    s2 = Sequence(model, pool2, cache2)
    turn2 = system + q1 + [5, 6, 7, 8, 9, 10, 11]  # a later turn of the first chat
    logits, n, tiers = s2.run(turn2)
    assert n == 40 and tiers["disk"] == 5 and s2.forwarded == len(turn2) - 40
    torch.testing.assert_close(logits, cold(turn2), rtol=1e-5, atol=1e-5)
