"""The process-wide CPU thread setting for kernel ops (``--cpu_infer``).

Kept apart from the kernels so that choosing a thread count never needs the C++ extension.
"""

from __future__ import annotations

import os

_threads: int | None = None


def physical_cores() -> int:
    """Physical cores of this machine (hyper-threads do not help bandwidth-bound decode)."""
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip() and core is not None:
                    cores.add((phys, core))
                    phys = core = None
            if core is not None:
                cores.add((phys, core))
        if cores:
            return min(len(cores), len(os.sched_getaffinity(0)))
    except OSError:
        pass
    return os.cpu_count() or 1


def set_cpu_infer_threads(n: int | None) -> None:
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"--cpu_infer must be at least 1, not {n}")
    _threads = n


def cpu_infer_threads() -> int:
    return _threads or physical_cores()
