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
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
GB = 1e9

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
