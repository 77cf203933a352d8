"""The process-wide CPU thread setting for kernel ops (``--cpu_infer``).

Kept apart from the kernels so that choosing a thread count never needs the C++ extension.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("ktransformers.kernels")

_threads: int | None = None
_claimed = False


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


def kernel_pool():
    """The shared CPU-kernel pool for ``--cpu_infer`` threads, with the cores handed to it.

    The pool's threads and torch's OpenMP threads spin on the same cores between calls; on a
    decode step (many short calls alternating between them) two torch threads made decode 2-7x
    slower on a 2-core machine.  Changing torch's thread count costs ~10 ms (MKL/oneDNN re-init),
    so it is set once, here, when the first kernel op loads: torch keeps the cores the pool does
    not use (at least 1).  An explicit ``OMP_NUM_THREADS`` or ``KT_TORCH_THREADS`` wins.
    """
    from .. import kernels as K

    n = cpu_infer_threads()
    pool = K.cpu_infer(n)
    global _claimed
    if not _claimed:
        _claimed = True
        _hand_cores_to_pool(n)
    return pool


def _hand_cores_to_pool(pool_threads: int) -> None:
    import torch

    want = os.environ.get("KT_TORCH_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if want:
        try:
            n = max(1, int(want))
        except ValueError:
            return
    else:
        n = max(1, physical_cores() - pool_threads)
    if torch.get_num_threads() != n:
        log.info("CPU kernels use %d thread(s); torch intra-op threads set to %d (KT_TORCH_THREADS overrides)",
                 pool_threads, n)
        torch.set_num_threads(n)
