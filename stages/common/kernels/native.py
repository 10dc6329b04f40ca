"""Attention over a KV cache as one native kernel, built on first use with the machine's C compiler.

In PyTorch operators a decode step's attention over a KV cache is several kernels per layer (the
scores' product, the mask's addition, a softmax's maximum, exponentials and sum, the values'
product, the merge of the shared and own columns), each a pass over memory, with a few queries a
key/value head: the operators between the products cost about as much as the products
(docs/results.md, *The engine's ceiling*). `decode_attention` computes the same attention in one C
function (``attention.c``): per row and key/value head, the scores of the group's queries eight
columns at a time while those keys are in L1, their exponentials, and the values' weighted sums,
three queries at a time with the accumulators in registers so each value is loaded once for them;
the columns every row shares are read from row 0, so threads working through one head's rows find
them in cache. It runs one task per row and head on PyTorch's thread count, in OpenMP's threads: the
library links libgomp.so.1, which resolves to the one PyTorch loaded, so the kernel and PyTorch's
operators share one pool of threads rather than contend for the cores. A prefill's new tokens over
the cache (`prefill_attention`) are the same computation with several tokens a row, each under its
own mask row: a task then takes a block of tokens, up to 48 queries, whose scores stay in L2 while
the values pass reads them. AVX2 and FMA. A float32 cache is read as it is; a bfloat16 cache is
widened to float32 as it is loaded (a bfloat16 is a float32's upper half), so scores, softmax and
the weighted sum are float32 arithmetic in both dtypes, rounded to bfloat16 only at the output,
where SDPA's bfloat16 kernel rounds too. On a CPU with AVX512-BF16 (`bf16_dots`), a bfloat16
model's scores are AVX512-BF16's dot products of its bfloat16 queries and keys, 16 columns at a
time: the products of two bfloat16 are exact in float32 and are summed in float32, so the scores
are the same float32 sums in another order, without widening a key; its weighted sums then run in
AVX512 registers, six queries a value load. The instructions are compiled into the same library
for those functions alone and taken where the CPU reports them.

`sample` (``sample.c``) draws a decode step's tokens from its logits: per row one pass for the
maximum and one for the exponentials, summed in blocks of 64 tokens, then the block and the token
where the cumulative sum passes the row's uniform times the total, and the token's log-probability
from the same sums. The operators it replaces (a scaling, a log-softmax, its exponentials, a
cumulative sum, a search, the gathers) each pass over the whole ``[rows, vocabulary]`` logits and
write a tensor of that size.

The library is compiled once per machine into ``$SPA_CACHE/kernels`` from ``attention.c`` and
``sample.c``, which share ``vectors.h`` (``cc -O3 -mavx2 -mfma -fopenmp``, about a second; ``$CC``
names another compiler) and loaded with ctypes: no PyTorch headers, no build step at install.
Where it cannot be had (not Linux on x86-64, a CPU without AVX2, no compiler, a failed build; for
the attention also a head size other than 64 or 128, more than 16 queries a key/value head)
`decode_attention`, `prefill_attention` and `sample` return None and the caller computes with
PyTorch's operators, as before. The attention's outputs equal the exact attention of the same
inputs up to float32 rounding, and a bfloat16 output its rounding (tests/test_kernels_native.py);
a drawn token is the one float64's cumulative distribution gives at its uniform
(tests/test_kernels_sample.py); the exponential is a polynomial within about 2 float32 ulps.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

#: The library's C sources, and the header they share.
SOURCES = tuple(Path(__file__).with_name(name) for name in ("attention.c", "sample.c"))
HEADER = Path(__file__).with_name("vectors.h")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
#: The head sizes and group sizes (query heads per key/value head) the kernel takes.
HEAD_DIMS, MAX_GROUP = (64, 128), 16
#: The dtypes of a KV cache the kernel reads (its arithmetic is float32 in both).
CACHE_DTYPES = (torch.float32, torch.bfloat16)
#: The masks it reads as they are (additive, or True where a query attends), in its argument's order.
MASK_DTYPES = (torch.float32, torch.bfloat16, torch.bool)
enabled = True  #: false keeps PyTorch's operators for the attention: benchmarks time them beside the kernel
sampling_enabled = True  #: false keeps PyTorch's operators for sampling (`sample`), likewise
#: false keeps a bfloat16 cache's scores on the widening path where the CPU has AVX512-BF16
#: (benchmarks and tests compare the two)
bf16_dots_enabled = True


def available() -> bool:
    """Whether the kernel runs here: this platform and CPU take it and its library is built (building
    it now if needed)."""
    return enabled and _library() is not None


def bf16_dots() -> bool:
    """Whether a bfloat16 model's scores are computed by AVX512-BF16 dot products here: the kernel
    runs, this CPU has the instructions, the compiler emitted them and `bf16_dots_enabled`."""
    return available() and bf16_dots_enabled and bool(_library().spa_bf16_dots())


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     shared: int, scale: float) -> torch.Tensor | None:
    """Attention of a one-token ``query`` ``[rows, heads, 1, dim]`` over ``key``/``value`` ``[rows,
    kv_heads, columns, dim]`` (views of a cache are fine: only the last dimension must be dense)
    under the additive ``mask`` ``[rows or 1, 1, 1, columns]``; columns ``[0, shared)`` hold the
    same keys and values in every row and are read from row 0. On a CPU, keys and values both float32
    or both bfloat16, computed in float32. Returns ``[rows, 1, heads, dim]`` in the query's dtype, or
    None where the kernel does not apply (see the module docstring)."""
    return _attention(query, key, value, mask, shared, scale, "spa::decode_attention")


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor | None:
    """Attention of ``query`` ``[rows, heads, tokens, dim]`` (a prefill's new tokens) over
    ``key``/``value`` ``[rows, kv_heads, columns, dim]`` (the cache, these tokens' columns included)
    under ``mask`` ``[rows or 1, 1, tokens or 1, columns]``, boolean (True: attend) or additive; as
    `decode_attention` otherwise. Returns ``[rows, tokens, heads, dim]``, or None."""
    return _attention(query, key, value, mask, 0, scale, "spa::prefill_attention")


def sample(logits: torch.Tensor, temperature: float,
           uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One token a row of ``logits`` ``[rows, vocab]`` (float32 or bfloat16, on the CPU, the last
    dimension dense) and its log-probability, in one C call. With ``uniforms`` (float32
    ``[rows]`` in [0, 1)): drawn from softmax(logits / temperature) by inverting its cumulative
    distribution at the row's uniform, the first token whose cumulative probability exceeds the
    uniform times the total, as ``torch.searchsorted(cdf, u * cdf[-1], right=True)`` picks; without
    (greedy): the first maximum, its log-probability under the untempered distribution. Returns
    (int64 tokens, float32 log-probs), or None where the kernel does not apply."""
    library = _library() if sampling_enabled else None
    if (library is None or logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype not in CACHE_DTYPES
            or logits.stride(-1) != 1 or (uniforms is not None and temperature <= 0)):
        return None
    rows = logits.shape[0]
    if uniforms is not None:
        uniforms = uniforms.to(torch.float32).contiguous()
    tokens, logprobs = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.float32)
    with torch.profiler.record_function("spa::sample"):
        status = library.spa_sample(
            logits.data_ptr(), logits.stride(0), rows, logits.shape[1], int(logits.dtype == torch.bfloat16),
            1.0 / temperature if uniforms is not None else 1.0, uniforms.data_ptr() if uniforms is not None else None,
            tokens.data_ptr(), logprobs.data_ptr(), torch.get_num_threads())
    return (tokens, logprobs) if status == 0 else None


def _attention(query, key, value, mask, shared: int, scale: float, label: str) -> torch.Tensor | None:
    rows, heads, tokens, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    group = heads // kv_heads
    library = _library() if enabled else None
    if (library is None or dim not in HEAD_DIMS or group > MAX_GROUP or columns == 0
            or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != columns  # one mask for all heads
            or key.dtype not in CACHE_DTYPES or value.dtype != key.dtype
            or any(t.device.type != "cpu" for t in (query, key, value, mask))
            or key.stride(-1) != 1 or value.stride(-1) != 1):
        return None
    if mask.dtype not in MASK_DTYPES:
        mask = mask.to(torch.float32)
    mask = mask.reshape(mask.shape[0], mask.shape[-2], columns)
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    dtype = query.dtype
    if dtype not in CACHE_DTYPES:
        query = query.to(torch.float32)
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(rows, tokens, heads, dim, dtype=query.dtype)  # the kernel reads and writes this dtype
    with torch.profiler.record_function(label):
        status = library.spa_attention(
            query.data_ptr(), key.data_ptr(), value.data_ptr(), mask.data_ptr(), out.data_ptr(), *query.stride()[:3],
            *key.stride()[:3], *value.stride()[:3], mask.stride(0) if mask.shape[0] > 1 else 0,
            mask.stride(1) if mask.shape[1] > 1 else 0, rows, kv_heads, group, tokens, dim, columns, shared,
            MASK_DTYPES.index(mask.dtype), int(key.dtype == torch.bfloat16), int(query.dtype == torch.bfloat16),
            int(bf16_dots_enabled), scale, torch.get_num_threads())
    return out.to(dtype) if status == 0 else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    path = _built()
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    function = library.spa_attention
    function.restype = ctypes.c_int
    function.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 11 + [ctypes.c_int] * 11
                         + [ctypes.c_float, ctypes.c_int])
    library.spa_bf16_dots.restype = ctypes.c_int
    library.spa_sample.restype = ctypes.c_int
    library.spa_sample.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return library


def _built() -> Path | None:
    """The compiled library, compiled now if this source, compiler and flags have none yet; None if
    there is no compiler or it fails."""
    from stages.common.models import cache_root

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    texts = [source.read_text() for source in (*SOURCES, HEADER)]
    digest = hashlib.sha256("\0".join([*texts, compiler, *FLAGS]).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"native-{digest}.so"
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES)], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp, path)  # another process building the same library at once loses nothing
        finally:
            Path(tmp).unlink(missing_ok=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return path
