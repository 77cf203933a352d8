"""Hand freed heap memory back to the operating system.

Building a large tokenizer (Gemma-3's 262k-token BPE: a 15 MB ``tokenizer.json``) leaves ~200 MB
of freed chunks in glibc's malloc arenas, and RSS keeps counting them for the life of the process:
a fifth of what ``local_chat`` on that model holds.  ``malloc_trim`` returns them."""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another libc or OS: nothing to do)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl has no malloc_trim
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_heap() -> bool:
    """Return the heap's free pages to the OS; True when some were released."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
