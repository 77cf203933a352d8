"""An in-test page pool with the PagePool interface of ktransformers.generation.paged, and a fake
"prefill" whose K/V depend on every earlier token (a prefix sum), as a real model's do."""

from __future__ import annotations

import torch


class OutOfPages(Exception):
    pass


class FakePool:
    """``num_pages`` pages of ``page_size`` slots; each page holds K and V of ``layers`` layers."""

    def __init__(self, num_pages: int, page_size: int, layers: int = 2, heads: int = 2, dim: int = 4,
                 dtype=torch.float32, with_refcount: bool = True):
        self.page_size, self.num_pages = page_size, num_pages
        self.layers = layers
        self.storage = torch.zeros(num_pages, layers, 2, page_size, heads, dim, dtype=dtype)
        self.refs = [0] * num_pages
        self._free = list(range(num_pages))[::-1]
        self.on_pressure = None
        self.writes = 0
        if with_refcount:
            self.refcount = lambda page: self.refs[page]

    def alloc(self) -> int:
        if not self._free and self.on_pressure is not None:
            self.on_pressure(1)
        if not self._free:
            raise OutOfPages("no free page")
        p = self._free.pop()
        self.refs[p] = 1
        return p

    def incref(self, page: int) -> None:
        assert self.refs[page] > 0, f"incref of free page {page}"
        self.refs[page] += 1

    def decref(self, page: int) -> None:
        assert self.refs[page] > 0, f"decref of free page {page}"
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.storage[page] = float("nan")  # a freed page's content must never be read again
            self._free.append(page)

    def free_count(self) -> int:
        return len(self._free)

    def used_count(self) -> int:
        return self.num_pages - len(self._free)

    def read_page(self, page: int) -> dict[str, torch.Tensor]:
        out = {}
        for layer in range(self.layers):
            out[f"layers.{layer}.k"] = self.storage[page, layer, 0]
            out[f"layers.{layer}.v"] = self.storage[page, layer, 1]
        return out

    def write_page(self, page: int, payload: dict[str, torch.Tensor]) -> None:
        self.writes += 1
        for layer in range(self.layers):
            self.storage[page, layer, 0] = payload[f"layers.{layer}.k"]
            self.storage[page, layer, 1] = payload[f"layers.{layer}.v"]


def slot_values(tokens: list[int], pos: int, layers: int, heads: int, dim: int) -> torch.Tensor:
    """K/V of position ``pos``: a function of all tokens up to it (like attention's inputs)."""
    s = float(sum(tokens[:pos + 1]) % 9973) + pos * 1e-3
    base = torch.arange(layers * 2 * heads * dim, dtype=torch.float32).reshape(layers, 2, heads, dim)
    return base + s


def prefill(pool: FakePool, tokens: list[int], prefix_pages: list[int] = (), n_cached: int = 0) -> list[int]:
    """A sequence's pages: the cached prefix pages, then new pages with the rest of its K/V."""
    ps = pool.page_size
    pages = list(prefix_pages)
    heads, dim = pool.storage.shape[-2:]
    for pos in range(n_cached, len(tokens)):
        if pos // ps >= len(pages):
            pages.append(pool.alloc())
        pool.storage[pages[pos // ps], :, :, pos % ps] = slot_values(tokens, pos, pool.layers, heads, dim)
    return pages


def expected_page(pool: FakePool, tokens: list[int], index: int) -> torch.Tensor:
    ps = pool.page_size
    heads, dim = pool.storage.shape[-2:]
    vals = [slot_values(tokens, pos, pool.layers, heads, dim) for pos in range(index * ps, (index + 1) * ps)]
    return torch.stack(vals, dim=2)  # layers, 2, slot, heads, dim


def release(pool: FakePool, pages: list[int]) -> None:
    for p in pages:
        pool.decref(p)
