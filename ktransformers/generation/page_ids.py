"""Reference-counted page ids: the bookkeeping both batch runners' page pools share.

The paged runner's pool (``generation/paged.py``) keeps each page's K/V rows in its storage
tensors; the reference runner's (``server/reference_runner.py``) only counts pages.  Both hand out,
share and free page ids here, so the scheduler's page accounting, preemption and the prefix cache's
reference counting behave the same over either.  Torch-free: the reference runner imports it where
the paged runner's kernels are not built.
"""

from __future__ import annotations

from collections.abc import Callable


class OutOfPages(Exception):
    """The pool has fewer free pages than an allocation needs (after asking ``on_pressure``)."""


class PageIds:
    """Page ids ``0 .. num_pages - 1`` with reference counts.

    * ``alloc()`` returns a free page with refcount 1.  With no free page it first calls
      ``on_pressure(1)`` (if set: "release up to n evictable pages", returns how many it released);
      if still none is free it raises ``OutOfPages`` and nothing changed.
    * ``incref`` / ``decref``: a page is free again when its count reaches 0 (``_freed(page)`` is
      called then).  ``incref`` or ``decref`` of a free page is a ``ValueError``.
    * ``reserve(n)``: ``n`` pages at once or none (pressure asked once for the shortfall).

    Not thread-safe: one engine thread drives the pool (and the runner).
    """

    def __init__(self, num_pages: int):
        self.num_pages = int(num_pages)
        self._refs = [0] * self.num_pages
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.on_pressure: Callable[[int], int] | None = None

    # -- counts
    def free_count(self) -> int:
        return len(self._free)

    def used_count(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[self._check(page)]

    # -- allocation
    def _relieve(self, n: int) -> None:
        if n > 0 and self.on_pressure is not None:
            self.on_pressure(n)

    def alloc(self) -> int:
        if not self._free:
            self._relieve(1)
        if not self._free:
            raise OutOfPages(f"page pool exhausted: all {self.num_pages} pages are in use")
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def reserve(self, n: int) -> list[int]:
        """``n`` fresh pages (refcount 1 each), or ``OutOfPages`` with none taken."""
        if n <= 0:
            return []
        if len(self._free) < n:
            self._relieve(n - len(self._free))
        if len(self._free) < n:
            raise OutOfPages(f"need {n} pages, {len(self._free)} of {self.num_pages} free")
        return [self.alloc() for _ in range(n)]

    def incref(self, page: int) -> None:
        p = self._check(page)
        if self._refs[p] == 0:
            raise ValueError(f"page {page} is free: incref needs a page someone holds")
        self._refs[p] += 1

    def decref(self, page: int) -> None:
        p = self._check(page)
        if self._refs[p] == 0:
            raise ValueError(f"page {page} is already free (decref without a matching reference)")
        self._refs[p] -= 1
        if self._refs[p] == 0:
            self._free.append(p)
            self._freed(p)

    def _freed(self, page: int) -> None:
        """``page``'s count reached 0: a pool that keeps something per page drops it here."""

    def _check(self, page) -> int:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page!r} out of range 0..{self.num_pages - 1}")
        return page
