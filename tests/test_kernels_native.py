"""`stages.common.kernels.native`, the attention over a KV cache of a decode step and of a prefill as
one C kernel: it is built where the machine can run it, gives the softmax attention computed in
float64 up to its float32 rounding (over a bfloat16 cache too, then rounded once to bfloat16), and
where it cannot be had (no compiler, no AVX2) the operators it replaces run."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from stages.common.kernels import attention, native

EPS = torch.finfo(torch.float32).eps
#: bfloat16's rounding of a float32 result: half its spacing, relative (8 bits of mantissa).
BF16_ROUNDING = torch.finfo(torch.bfloat16).eps / 2


def can_build() -> bool:
    return (platform.system() == "Linux" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
            and (shutil.which("cc") or shutil.which("gcc")) is not None)


@pytest.fixture
def rebuilt(monkeypatch, tmp_path):
    """A fresh build in an empty cache directory, forgotten again after the test."""
    monkeypatch.setenv("SPA_CACHE", str(tmp_path))
    native._library.cache_clear()
    yield
    native._library.cache_clear()


def decode_case(rows: int, kv_heads: int, group: int, dim: int, shared: int, own: int, capacity: int,
                seed: int = 0):
    """A decode step's tensors as the hf backend holds them: keys and values views of slabs with
    ``capacity`` columns, the first ``shared`` the same in every row; row 1 has padding among its
    own columns, the last row sees none of them. Returns (query, key, value, additive mask)."""
    generator = torch.Generator().manual_seed(seed)
    columns = shared + own
    slabs = [torch.randn(rows, kv_heads, capacity, dim, generator=generator) for _ in range(2)]
    for slab in slabs:
        slab[1:, :, :shared] = slab[:1, :, :shared]
    keep = torch.ones(rows, 1, 1, columns, dtype=torch.bool)
    keep[1, ..., shared:shared + own // 2] = False
    keep[-1, ..., shared:] = False
    mask = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
    query = torch.randn(rows, kv_heads * group, 1, dim, generator=generator)
    return query, slabs[0][:, :, :columns], slabs[1][:, :, :columns], mask


def float64_attention(query, key, value, mask, scale):
    """softmax(q k^T scale + mask) v in float64, grouped heads; ``[rows, 1, heads, dim]``, zeros for a
    query that sees no column."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.double().reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = grouped @ key.double().transpose(-1, -2) * scale + mask.double().reshape(mask.shape[0], 1, 1, -1)
    return (scores.softmax(-1) @ value.double()).nan_to_num(0.0).reshape(rows, 1, heads, dim)


def float32_bound(query, key, value, scale) -> float:
    """How far the kernel's float32 arithmetic may land from the float64 attention. A score sums
    dim / 8 products per lane and then 8 lanes (3 levels), then is scaled and masked: at most
    (dim / 8 + 5) roundings of the largest sum of |q k| scale (AVX512-BF16's dot products: dim / 16
    additions a lane, then 16 lanes in 4 levels, fewer). Its weight exp(score - top) moves by
    twice that error relatively (score and top), plus the exponential's 2 ulps and the subtraction's
    one. The weights' and the values' sums add a rounding a column at most (sequential sums). The
    output, an average of values, moves by max|v| times the weights' relative error, twice (sum and
    normaliser)."""
    rows, heads, tokens, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads * tokens, dim).abs()
    largest = (grouped @ key.abs().transpose(-1, -2)).max().item() * scale
    score_error = (dim / 8 + 5) * EPS * largest
    weight_error = 2 * score_error + 3 * EPS
    return value.abs().max().item() * (2 * weight_error + 2 * (columns + 4) * EPS)


def _kernels_dir():
    from stages.common.models import cache_root

    return cache_root() / "kernels"


def test_the_kernel_is_built_where_the_machine_can_run_it(rebuilt):
    assert native.available() == can_build()
    if can_build():
        assert list(_kernels_dir().glob("native-*.so"))


needs_kernel = pytest.mark.skipif(not can_build(), reason="the kernel needs Linux, AVX2 and a C compiler")


@needs_kernel
@pytest.mark.parametrize(("rows", "kv_heads", "group", "dim", "shared", "own"), [
    (4, 3, 3, 64, 13, 32),  # SmolLM2's heads; 45 columns: five blocks of 8 and a tail of 5
    (3, 2, 7, 128, 0, 20),  # Qwen2.5-7B's heads, no shared columns
    (5, 1, 1, 64, 8, 8),  # one query a head; exactly two blocks
])
def test_decode_attention_equals_the_float64_softmax(rows, kv_heads, group, dim, shared, own):
    query, key, value, mask = decode_case(rows, kv_heads, group, dim, shared, own, capacity=shared + own + 19)
    scale = dim ** -0.5
    ours = native.decode_attention(query, key, value, mask, shared, scale)
    assert ours is not None and ours.shape == (rows, 1, kv_heads * group, dim) and ours.dtype == torch.float32
    reference = float64_attention(query, key, value, mask, scale)
    assert (ours.double() - reference).abs().max().item() <= float32_bound(query, key, value, scale)
    if not shared:  # the last row sees no column at all
        assert torch.equal(ours[-1], torch.zeros_like(ours[-1]))


def cpu_has_bf16_dots() -> bool:
    """What /proc/cpuinfo says of AVX512-BF16 (the kernel asks the CPU itself)."""
    with open("/proc/cpuinfo") as cpuinfo:
        return "avx512_bf16" in cpuinfo.read().split()


@needs_kernel
def test_bf16_dot_products_are_used_exactly_where_the_cpu_has_them(monkeypatch):
    assert native.bf16_dots() == cpu_has_bf16_dots()
    monkeypatch.setattr(native, "bf16_dots_enabled", False)
    assert not native.bf16_dots()


@needs_kernel
@pytest.mark.parametrize("dots", [True, False], ids=["bf16_dots_where_the_cpu_has_them", "widened"])
@pytest.mark.parametrize(("group", "dim", "shared"), [(3, 64, 13), (7, 128, 0)])
def test_over_a_bfloat16_cache_the_arithmetic_is_float32(monkeypatch, group, dim, shared, dots):
    """A bfloat16 cache (the engine's in `model.dtype: bfloat16`) read by the same float32
    arithmetic, its scores by AVX512-BF16's dot products where the CPU has them (bfloat16 products
    are exact in float32) or by widening each key: the output is the float64 attention of the same
    bfloat16 numbers within the float32 bound, plus one rounding to bfloat16 at the end, not
    bfloat16's error compounded through the scores and the softmax. 27 own columns: the 16-column
    blocks of the dot products end in a partial one."""
    monkeypatch.setattr(native, "bf16_dots_enabled", dots)
    tensors = decode_case(4, 2, group, dim, shared, 27, capacity=shared + 40)
    query, key, value, mask = (t.to(torch.bfloat16) for t in tensors)
    scale = dim ** -0.5
    ours = native.decode_attention(query, key, value, mask, shared, scale)
    assert ours is not None and ours.dtype == torch.bfloat16 and ours.shape == (4, 1, 2 * group, dim)
    reference = float64_attention(query, key, value, mask, scale)  # bfloat16 is exact in float64
    error = (ours.double() - reference).abs()
    bound = float32_bound(query.float(), key.float(), value.float(), scale) * (1 + BF16_ROUNDING)
    assert (error <= bound + reference.abs() * BF16_ROUNDING).all()


@needs_kernel
def test_a_float32_query_over_a_bfloat16_cache_is_not_rounded():
    """The dot products take bfloat16 queries only: a float32 query (not a bfloat16 number) over a
    bfloat16 cache keeps its float32 digits, within the float32 bound of the exact attention, where
    rounding it to bfloat16 would move the scores by about 2^-9 of their size."""
    query, key, value, mask = decode_case(4, 2, 3, 64, 13, 27, capacity=60)
    key, value = key.to(torch.bfloat16), value.to(torch.bfloat16)
    ours = native.decode_attention(query, key, value, mask, 13, 0.125)
    assert ours is not None and ours.dtype == torch.float32
    reference = float64_attention(query, key, value, mask, 0.125)
    assert (ours.double() - reference).abs().max().item() <= float32_bound(query, key.float(), value.float(), 0.125)


def prefill_case(rows: int, kv_heads: int, group: int, tokens: int, cached: int, dtype=torch.float32, seed: int = 0):
    """A prefill of ``tokens`` new tokens a row over ``cached`` cached columns, as the hf backend
    runs one: causal among the new tokens, row 1 with padding among its cached columns, the last
    row's first new token a padding query that may see nothing. Returns (query, key, value, boolean
    mask ``[rows, 1, tokens, columns]``)."""
    generator = torch.Generator().manual_seed(seed)
    columns = cached + tokens
    key, value = (torch.randn(rows, kv_heads, columns, 64, generator=generator).to(dtype) for _ in range(2))
    query = torch.randn(rows, kv_heads * group, tokens, 64, generator=generator).to(dtype)
    keep = torch.ones(tokens, columns, dtype=torch.bool).tril(diagonal=cached).repeat(rows, 1, 1, 1)
    keep[1, ..., 2:cached // 2] = False
    keep[-1, :, 0] = False
    return query, key, value, keep


@needs_kernel
@pytest.mark.parametrize(("group", "tokens", "dtype", "dots"), [
    (3, 20, torch.float32, False),  # SmolLM2's group: blocks of 16 tokens, then 4
    (7, 13, torch.float32, False),  # Qwen2.5-7B's: blocks of 6, 6 and 1
    (3, 20, torch.bfloat16, True),
    (3, 20, torch.bfloat16, False),
    (7, 13, torch.bfloat16, True),
])
def test_prefill_attention_equals_the_float64_softmax(monkeypatch, group, tokens, dtype, dots):
    monkeypatch.setattr(native, "bf16_dots_enabled", dots)
    query, key, value, keep = prefill_case(3, 2, group, tokens, cached=29, dtype=dtype)
    ours = native.prefill_attention(query, key, value, keep, 0.125)
    assert ours is not None and ours.shape == (3, tokens, 2 * group, 64) and ours.dtype == dtype
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill_(~keep, float("-inf"))
    scores = (query.double().reshape(3, 2, group * tokens, 64) @ key.double().transpose(-1, -2) * 0.125)
    scores = scores.view(3, 2, group, tokens, -1) + additive.view(3, 1, 1, tokens, -1)
    reference = (scores.softmax(-1) @ value.double()[:, :, None]).nan_to_num(0.0)
    reference = reference.reshape(3, 2 * group, tokens, 64).transpose(1, 2)
    bound = float32_bound(query.float(), key.float(), value.float(), 0.125)
    rounding = BF16_ROUNDING if dtype == torch.bfloat16 else 0.0
    assert ((ours.double() - reference).abs() <= bound * (1 + rounding) + reference.abs() * rounding).all()
    assert torch.equal(ours[-1, 0], torch.zeros_like(ours[-1, 0]))  # the padding query: zeros, never NaN


@needs_kernel
def test_a_prefill_over_cached_keys_is_the_kernels_and_gives_sdpas_result(monkeypatch):
    """`spa_sdpa` sends a masked prefill over cached keys to the kernel (where oneDNN's products do
    not run it instead), with transformers' output layout."""
    calls = []
    real = native.prefill_attention
    monkeypatch.setattr(native, "prefill_attention", lambda *args: calls.append(1) or real(*args))
    monkeypatch.setattr(attention, "onednn_prefill_attention_pays", lambda: False)
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = 3, True
    query, key, value, keep = prefill_case(3, 2, 3, 7, cached=11)
    keep[-1, :, 0] = True  # every query sees a column: SDPA's result is then defined everywhere
    with torch.no_grad():
        ours, _ = attention.spa_sdpa(module, query, key, value, keep, scaling=0.125)
    stock, _ = sdpa_attention_forward(module, query, key, value, keep, scaling=0.125)
    assert calls == [1] and ours.shape == stock.shape == (3, 7, 6, 64)
    assert (ours - stock).abs().max().item() <= 2 * float32_bound(query, key, value, 0.125)


@needs_kernel
def test_one_mask_row_serves_every_row():
    query, key, value, _ = decode_case(3, 2, 3, 64, 6, 10, capacity=16)
    one = torch.zeros(1, 1, 1, 16)
    one[..., 8] = float("-inf")
    ours = native.decode_attention(query, key, value, one, 6, 0.125)
    reference = float64_attention(query, key, value, one, 0.125)
    assert (ours.double() - reference).abs().max().item() <= float32_bound(query, key, value, 0.125)


@needs_kernel
def test_shapes_the_kernel_does_not_take_go_back_to_the_operators():
    query, key, value, mask = decode_case(2, 2, 3, 64, 4, 4, capacity=8)
    assert native.decode_attention(query[..., :32], key[..., :32], value[..., :32], mask, 4, 0.1) is None  # dim 32
    assert native.decode_attention(query.double(), key.double(), value.double(), mask.double(), 4, 0.1) is None
    assert native.decode_attention(query, key, value.to(torch.bfloat16), mask, 4, 0.1) is None  # mixed cache
    assert native.decode_attention(query, key, value, mask.expand(2, 6, 1, 8), 4, 0.1) is None  # a mask per head
    assert native.decode_attention(query, key.transpose(-1, -2).contiguous().transpose(-1, -2), value, mask, 4,
                                   0.1) is None  # keys not dense along the head dimension


@needs_kernel
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_shared_prefix_attention_gives_sdpas_result_with_and_without_the_kernel(monkeypatch, mask_kind):
    """The attention `spa_sdpa` computes for a decode step over shared columns, through the kernel
    and through PyTorch's operators, against transformers' SDPA."""
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = 3, True
    query, key, value, mask = decode_case(4, 3, 3, 64, 13, 32, capacity=50)
    keep = mask == 0
    given = keep if mask_kind == "bool" else mask
    stock, _ = sdpa_attention_forward(module, query, key, value, keep, scaling=0.125)
    # Both are within the float32 rounding of the float64 attention; SDPA's is too, by the same bound.
    bound = 2 * float32_bound(query, key, value, 0.125)
    for enabled in (True, False):
        monkeypatch.setattr(native, "enabled", enabled)
        ours = attention.shared_prefix_attention(query, key, value, given, 13, 0.125)
        assert (ours - stock).abs().max().item() <= bound


@pytest.mark.parametrize("missing", ["compiler", "avx2"])
def test_without_a_compiler_or_avx2_the_operators_compute_it(monkeypatch, rebuilt, missing):
    if missing == "compiler":
        monkeypatch.setenv("CC", "/nonexistent/cc")
    else:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert not native.available()
    query, key, value, mask = decode_case(4, 3, 3, 64, 13, 32, capacity=50)
    assert native.decode_attention(query, key, value, mask, 13, 0.125) is None
    assert native.prefill_attention(*prefill_case(2, 2, 3, 5, cached=7), 0.125) is None
    assert native.sample(torch.zeros(2, 10), 1.0, torch.full((2,), 0.5)) is None
    ours = attention.shared_prefix_attention(query, key, value, mask, 13, 0.125)
    reference = float64_attention(query, key, value, mask, 0.125)
    assert (ours.double() - reference).abs().max().item() <= 2 * float32_bound(query, key, value, 0.125)
    assert not list(_kernels_dir().glob("*"))  # nothing half-built left behind


@needs_kernel
def test_a_bfloat16_output_is_the_float32_sums_rounded_once_as_pytorch_rounds(monkeypatch):
    """With bfloat16 queries the kernel writes bfloat16: the same float32 arithmetic as for float32
    queries holding the same numbers, rounded to nearest (ties to even) as ``Tensor.to`` rounds, bit
    for bit; and a query given as a strided view (a prefill's, transposed from the projections'
    layout) reads the same numbers as a contiguous one."""
    query, key, value, keep = prefill_case(3, 2, 3, 20, cached=29, dtype=torch.bfloat16)
    monkeypatch.setattr(native, "bf16_dots_enabled", False)  # the widening path: float32's scores
    ours = native.prefill_attention(query, key, value, keep, 0.125)
    wide = native.prefill_attention(query.float(), key, value, keep, 0.125)
    assert ours.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert torch.equal(ours, wide.to(torch.bfloat16))
    strided = query.transpose(1, 2).contiguous().transpose(1, 2)  # [rows, heads, tokens, dim], tokens outermost
    assert not strided.is_contiguous()
    monkeypatch.setattr(native, "bf16_dots_enabled", True)
    assert torch.equal(native.prefill_attention(strided, key, value, keep, 0.125),
                       native.prefill_attention(query, key, value, keep, 0.125))
