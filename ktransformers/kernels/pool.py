"""The CPU thread pool (``CPUInfer``): one per thread count, shared by every kernel."""

from __future__ import annotations

import logging
import operator
import os
import threading
from typing import Any

from .. import cpuinfer_ext as _ext

log = logging.getLogger("ktransformers.kernels")

_logged = False
_lock = threading.Lock()
_pools: dict[tuple[int | None, int | None], "CPUInfer"] = {}


def _proc_bytes(path: str, field: str) -> int | None:
    """The ``field:  N kB`` line of a Linux /proc file in bytes, or None when unknown."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def free_host_bytes() -> int | None:
    """Bytes a new host allocation can take (Linux MemAvailable), or None when unknown."""
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def resident_bytes() -> int | None:
    """This process's resident memory (Linux VmRSS), or None when unknown."""
    return _proc_bytes("/proc/self/status", "VmRSS")


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
    """Thread pool + async task queue.  ``threads`` counts the computing thread itself.

    ``numa_node=n`` (or an explicit ``cpus`` set) pins the pool's threads to those CPUs: they are
    started while the creating thread is bound to them, so they inherit that mask (the creating
    thread's own mask is restored).  ``threads`` then defaults to their number.  A task's first share
    runs on the thread that calls ``forward`` or ``sync``; bind that thread to ``pool.cpus`` too
    (``os.sched_setaffinity(0, pool.cpus)``) to keep every share on the node.
    """

    def __init__(self, threads: int | None = None, numa_node: int | None = None, cpus: Any = None):
        if numa_node is not None and cpus is not None:
            raise ValueError("numa_node, cpus: give one of them, not both")
        if numa_node is not None:
            from .numa import node_cpus

            cpus = node_cpus(numa_node)
        elif cpus is not None:
            cpus = _usable_cpus(cpus)
        if threads is None:
            threads = len(cpus) if cpus is not None else (os.cpu_count() or 1)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads: expected a positive int, got {threads!r}")
        _log_tier_once()
        self.numa_node = numa_node
        self.cpus: tuple[int, ...] | None = cpus
        if cpus is None:
            self._c = _ext.CPUInfer(threads)
        else:
            saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, cpus)
            try:
                self._c = _ext.CPUInfer(threads)  # workers and queue thread inherit the mask
            finally:
                os.sched_setaffinity(0, saved)
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


def _usable_cpus(cpus: Any) -> tuple[int, ...]:
    """An explicit CPU set, checked against the CPUs this thread may run on."""
    try:
        want = sorted({operator.index(c) for c in cpus})
    except (TypeError, ValueError):
        raise ValueError(f"cpus: expected CPU numbers, got {cpus!r}") from None
    allowed = os.sched_getaffinity(0)
    outside = [c for c in want if c not in allowed]
    if not want or outside:
        from .numa import format_cpulist

        raise ValueError(f"cpus: {format_cpulist(outside) if outside else 'empty'}: not CPUs this process may run "
                         f"on (allowed: {format_cpulist(allowed)})")
    return tuple(want)


def cpu_infer(threads: int | None = None, numa_node: int | None = None) -> CPUInfer:
    """Process-wide pool for this thread count (and NUMA node, when given), created on first use."""
    if numa_node is None and threads is None:
        threads = os.cpu_count() or 1
    with _lock:
        key = (threads, numa_node)
        if key not in _pools:
            _pools[key] = CPUInfer(threads, numa_node=numa_node)
        return _pools[key]
