"""Host memory reuse for XLA's CPU buffers (glibc malloc settings, applied by the entry points that run JAX).

XLA on CPU allocates each execution's scratch memory (activations, gradients: 90 MB for a small train step) with
malloc from its worker threads. glibc serves an allocation that large with a fresh mmap from a thread's own arena,
and returns it to the system on free, so every step faults in every page of it again: 22,000 page faults per step
of the benchmark model at 1 x 128 tokens, about 8% of its time. With one arena, no mmap and no trimming, freed
memory stays in the process and the next step reuses it without a fault.

The cost: the process keeps its peak heap (as a GPU allocator keeps its pool), and all threads share one malloc
arena: a process-wide choice, so importing ipa_jax changes nothing and the entry points (experiments/*.py that run
JAX, the benchmarks, the dev server) call `keep_freed_host_memory()` first. Set IPA_JAX_KEEP_HOST_MEMORY=0 to keep
glibc's defaults. The arena setting only reaches threads that have not allocated yet, so call it before JAX starts
its CPU thread pool (its first computation); called later it gets the rest of the effect only.
"""

import ctypes
import os

ENV_VAR = "IPA_JAX_KEEP_HOST_MEMORY"

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER_TRIM = 2**31 - 1  # bytes of free heap top kept before trimming (mallopt takes an int)
_kept = False  # whether keep_freed_host_memory applied the settings in this process


def keep_freed_host_memory() -> bool:
    """Make glibc malloc keep freed memory for reuse: one arena, no mmap, no trimming (module doc). Returns whether
    the settings were applied: False without glibc (macOS, musl) or when IPA_JAX_KEEP_HOST_MEMORY=0."""
    global _kept
    if os.environ.get(ENV_VAR, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # only glibc's mallopt takes these parameters
        return False
    _kept = all(
        libc.mallopt(param, value) == 1
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM))
    )
    return _kept


def host_memory_kept() -> bool:
    """Whether keep_freed_host_memory() applied the settings in this process (recorded by the benchmarks)."""
    return _kept
