"""The peak resident memory (RSS) of this process, per stage.

`spa pipeline` runs its stages one after another in one process (vLLM's engine core too, in the
default `VLLM_ENABLE_V1_MULTIPROCESSING=0`), so a stage's peak is this process's high-water mark
over the stage. On Linux that mark (VmHWM in /proc/self/status) is set back to the current RSS by
writing "5" to /proc/self/clear_refs, which `reset_peak` does before each stage; the record then
says ``"peak_rss_since": "stage"``. Where that cannot be done (macOS, a read-only /proc) the figure
is the process's lifetime peak (`resource.getrusage`), and the record says ``"process"``: a later
stage's figure then includes every earlier one's. A stage run alone (`spa sft`, `spa ppo`) reports
its process's peak, which is the stage's (imports included).

Sizes are decimal gigabytes (1e9 bytes), as `free -g --si` and the benchmarks print them.

glibc's heap is steered here too. glibc serves a block above its *mmap threshold* from a fresh
mapping, whose pages fault in on first touch (each fault costs microseconds in a VM) and go back to
the OS when it is freed; it starts that threshold at 128 KiB and raises it, up to 32 MiB, only as
such blocks are freed, trimming the heap's top above twice the threshold. A fresh process's first
forwards thus fault in most of their tensors anew. `load_model` starts the heap where glibc's own
rule ends up (`heap_at_steady_state`); generation, whose tensors all die with each forward, keeps
even larger blocks in the heap while it runs (`blocks_kept_in_heap`), so each forward reuses the
last one's pages, where glibc allows it: up to 2.34 (RHEL 9, Amazon Linux 2023) glibc refuses an
mmap threshold above half its HEAP_MAX_SIZE, 32 MiB on 64-bit, and generation then keeps the steady
threshold. `return_freed_memory` hands free pages back between stages and before training passes.
"""

from __future__ import annotations

import contextlib
import functools
import resource
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
GB = 1e9

#: mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: glibc's ceiling for its dynamic mmap threshold on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX), and
#: the largest one glibc up to 2.34 lets mallopt set (HEAP_MAX_SIZE / 2).
STEADY_MMAP_THRESHOLD = 32 * 2**20
#: While generating: a prefill forward's largest activations (thousands of tokens x the MLP's width)
#: are tens of MB, all freed by the forward's end.
GENERATION_MMAP_THRESHOLD = 2**30

_reset_since_start = False


def reset_peak() -> bool:
    """Start a new peak at the current RSS; False where the platform cannot (the peak then stays the
    process's)."""
    global _reset_since_start
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    _reset_since_start = True
    return True


def peak() -> dict[str, Any]:
    """{"peak_rss_gb": the peak since the last `reset_peak` (or since the process started),
    "peak_rss_since": "stage" or "process"}."""
    high_water = _status_bytes("VmHWM")
    if high_water is not None:
        return {"peak_rss_gb": round(high_water / GB, 3), "peak_rss_since": "stage" if _reset_since_start else "process"}
    return {"peak_rss_gb": round(_lifetime_peak_bytes() / GB, 3), "peak_rss_since": "process"}


def current_gb() -> float:
    """The resident memory now (VmRSS), in GB; the lifetime peak where /proc is absent."""
    now = _status_bytes("VmRSS")
    return round((now if now is not None else _lifetime_peak_bytes()) / GB, 3)


def _status_bytes(field: str) -> int | None:
    try:
        lines = STATUS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    return None


def _lifetime_peak_bytes() -> int:
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak_rss if sys.platform == "darwin" else peak_rss * 1024  # bytes on macOS, KiB elsewhere


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS now (glibc's `malloc_trim`). Memory a pass freed
    otherwise stays resident, and whatever is allocated next (another network's pass, the next
    stage's model) comes on top of it instead of into it. A no-op where glibc is absent."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def heap_at_steady_state() -> None:
    """Set glibc's mmap threshold to `STEADY_MMAP_THRESHOLD` and its trim threshold to twice that:
    where its dynamic rule ends up, from the start (see the module docstring). A no-op where glibc
    is absent."""
    _set_thresholds(STEADY_MMAP_THRESHOLD)


@contextlib.contextmanager
def blocks_kept_in_heap() -> Iterator[int | None]:
    """Within: every block below the mmap threshold it yields comes from the heap and stays there
    when freed, for the next forward to reuse. That threshold is `GENERATION_MMAP_THRESHOLD`, or
    where glibc refuses it (up to 2.34) the largest it accepts, `STEADY_MMAP_THRESHOLD`: larger
    blocks then come from mappings of their own, as outside; None where glibc is absent or refuses
    both. After: the steady thresholds again, under which glibc may trim what is free above them at
    the heap's top; `return_freed_memory` hands back the rest. For code whose large tensors all die
    before it returns."""
    in_force = next((threshold for threshold in (GENERATION_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)
                     if _set_thresholds(threshold)), None)
    if in_force is None:
        yield None
        return
    try:
        yield in_force
    finally:
        _set_thresholds(STEADY_MMAP_THRESHOLD)


def _set_thresholds(mmap_threshold: int) -> bool:
    """glibc's mmap threshold, and its trim threshold at twice that (at most C int's maximum), as
    its dynamic rule pairs them; False where glibc is absent or refuses (mallopt answers 0)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    trim = min(2 * mmap_threshold, 2**31 - 1)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, trim))


@functools.cache
def _glibc():
    """The C library through ctypes, or None where it cannot be loaded."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None
