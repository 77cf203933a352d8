"""float64 numpy references for the MoE and linear kernels."""

from __future__ import annotations

import numpy as np


def act_fn(name: str, g: np.ndarray, u: np.ndarray, alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    if name == "silu":
        return g / (1 + np.exp(-g)) * u
    if name == "gelu_tanh":
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
    if name == "clamp_swiglu":
        gc = np.minimum(g, limit)
        uc = np.clip(u, -limit, limit)
        return (uc + 1) * gc / (1 + np.exp(-alpha * gc))
    if name == "clamp_silu":
        gc = np.minimum(g, limit)
        return gc / (1 + np.exp(-gc)) * np.clip(u, -limit, limit)
    raise ValueError(name)


def moe_ref(x, ids, w, G, U, D, act="silu", limit=7.0, clamped=None):
    """x [T,H], ids [T,k], w [T,k], G/U [E,I,H], D [E,H,I] (float) -> [T,H] float64.
    ``clamped`` (a list) receives the fraction of gate pre-activations above ``limit``."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for e in np.unique(ids):
        if e < 0:
            continue
        t, j = np.nonzero(ids == e)
        xe = x[t]
        g = xe @ G[e].T.astype(np.float64)
        if clamped is not None:
            clamped.append(float(np.mean(g > limit)))
        h = act_fn(act, g, xe @ U[e].T.astype(np.float64), limit=limit)
        y = h @ D[e].T.astype(np.float64)
        np.add.at(out, t, y * w[t, j][:, None])
    return out


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| (Frobenius): error relative to the output's scale."""
    out = np.asarray(out, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
