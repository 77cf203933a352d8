"""The CPU thread pool (``CPUInfer``): one per thread count, shared by every kernel."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from .. import cpuinfer_ext as _ext

log = logging.getLogger("ktransformers.kernels")

_logged = False
_lock = threading.Lock()
_pools: dict[int, "CPUInfer"] = {}


def free_host_bytes() -> int | None:
    """Bytes a new host allocation can take (Linux MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def isa_tier() -> str:
    """ISA tier in force; raises ValueError for an invalid or unsupported KT_ISA."""
    try:
        return _ext.isa_tier()
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"cannot select CPU kernels: {e}") from None


def _log_tier_once() -> None:
    global _logged
    tier = isa_tier()
    if not _logged:
        _logged = True
        log.info("CPU kernels: ISA tier %s (best supported %s)", tier, _ext.best_isa_tier())


class CPUInfer:
    """Thread pool + async task queue.  ``threads`` counts the computing thread itself."""

    def __init__(self, threads: int | None = None):
        threads = (os.cpu_count() or 1) if threads is None else threads
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads: expected a positive int, got {threads!r}")
        _log_tier_once()
        self._c = _ext.CPUInfer(threads)
        self._keep: list[Any] = []

    @property
    def threads(self) -> int:
        return self._c.threads

    def sync(self) -> None:
        """Wait for all submitted tasks; re-raises the first task error."""
        try:
            self._c.sync()
        finally:
            self._keep.clear()

    def probe_read_bw(self, nbytes: int = 1 << 30, reps: int = 5) -> float:
        """Best-of-reps DRAM read bandwidth with all pool threads, GB/s."""
        return self._c.probe_read_bw(int(nbytes), int(reps))

    def probe_peak(self, kind: str = "fp32", iters: int = 5_000_000) -> float:
        """Register-only peak with all threads: 'fp32' (GFLOP/s), 'bf16' (GFLOP/s), 'int8' (GOP/s)."""
        return self._c.probe_peak({"fp32": 0, "bf16": 1, "int8": 2}[kind], int(iters))


def cpu_infer(threads: int | None = None) -> CPUInfer:
    """Process-wide pool for this thread count (created on first use)."""
    threads = (os.cpu_count() or 1) if threads is None else threads
    with _lock:
        if threads not in _pools:
            _pools[threads] = CPUInfer(threads)
        return _pools[threads]
