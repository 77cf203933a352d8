"""release_free_heap hands freed malloc memory back: RSS drops after a fragmented free."""

import sys

import pytest

from ktransformers.util.heap import _malloc_trim, release_free_heap


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux") or _malloc_trim() is None,
                    reason="reads /proc/self/statm; needs glibc's malloc_trim")
def test_freed_chunks_leave_rss():
    # 64 MiB of 8 KiB malloc chunks (above pymalloc's small-object limit, below mmap's threshold),
    # freed except one near the top of the heap, which keeps the heap from shrinking by itself
    chunks = [bytearray(8192) for _ in range(8192)]
    for c in chunks:
        c[::4096] = b"\1" * len(c[::4096])  # touch every page
    keep = chunks[-1]
    del chunks[:-1]
    before = _rss_mib()
    assert release_free_heap()
    assert before - _rss_mib() > 32, "malloc_trim released less than half of 64 MiB freed"
    assert keep[0] == 1
