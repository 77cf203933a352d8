"""torch imported where it is first used, so the type table and the converter's light path run
without it while the block codecs, once called, pay nothing extra."""

from __future__ import annotations


def lazy_torch(module_globals: dict):
    """A stand-in for ``torch`` in a module's globals: the first attribute read imports torch and
    puts the real module in its place, so every later lookup is the plain global."""

    class _Torch:
        def __getattr__(self, name: str):
            import torch

            module_globals["torch"] = torch
            return getattr(torch, name)

    return _Torch()
