"""The process-wide CPU thread setting for kernel ops (``--cpu_infer``).

Kept apart from the kernels so that choosing a thread count never needs the C++ extension.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("ktransformers.kernels")

_threads: int | None = None
_claimed = False
#: a forward of at least this many tokens (prefill) runs torch on every physical core.  Measured on
#: 2 cores (bench/e2e.py, prefill tok/s with / without): Gemma-3-270M 512 tokens +20-37 %, 256 and 128
#: -19..+12 % (noise-level); the Qwen3-MoE-shaped model 512 +3-18 %, 256 +8-10 %, 128 -18..0 %.
PREFILL_TORCH_TOKENS = 256


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


def use_threads(n: int | None = None) -> None:
    """``--cpu_infer n`` (default: physical cores): the CPU kernels' pool size, and torch's intra-op
    threads until the first kernel op loads and takes its cores (``kernel_pool``)."""
    import torch

    n = n or physical_cores()
    set_cpu_infer_threads(n)
    torch.set_num_threads(n)


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


def _torch_threads_env() -> str | None:
    """The thread count the user fixed for torch (``KT_TORCH_THREADS``, else ``OMP_NUM_THREADS``)."""
    return os.environ.get("KT_TORCH_THREADS") or os.environ.get("OMP_NUM_THREADS")


def _hand_cores_to_pool(pool_threads: int) -> None:
    import torch

    want = _torch_threads_env()
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


def install_prefill_threads(model) -> None:
    """Give torch every physical core while ``model`` runs a forward of at least
    ``PREFILL_TORCH_TOKENS`` tokens, and the pool's share back after it.

    Between decode steps torch keeps only the cores the kernel pool does not use (see
    ``kernel_pool``), which leaves prefill attention (SDPA over hundreds of tokens, norms, rotary
    embedding) on one core of a 2-core machine while the pool's threads sleep.  Switching the count
    twice per prefill forward costs a few ms at most.  Below that size the switch does not pay: after
    each op torch's idle workers spin a while on the cores the pool's next call needs.  Nothing
    changes where the kernel pool never took the cores, torch already has all of them, or
    ``KT_TORCH_THREADS`` / ``OMP_NUM_THREADS`` fix the count.
    """
    import torch

    saved: list[int | None] = []

    def tokens_of(args, kwargs) -> int:
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
            x = x[..., 0] if x is not None else None
        if x is None and args and isinstance(args[0], torch.Tensor):
            x = args[0]
        return x.numel() if isinstance(x, torch.Tensor) else 0

    def before(module, args, kwargs):
        raise_to = None
        if _claimed and not _torch_threads_env() and tokens_of(args, kwargs) >= PREFILL_TORCH_TOKENS:
            cores, now = physical_cores(), torch.get_num_threads()
            if now < cores:
                torch.set_num_threads(cores)
                raise_to = now
        saved.append(raise_to)  # one entry per forward, so a nested forward restores nothing early

    def after(module, args, kwargs, output):
        back = saved.pop() if saved else None
        if back is not None:
            torch.set_num_threads(back)

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)
