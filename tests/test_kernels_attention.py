"""spa's attention kernels (`stages.common.kernels.attention`) against transformers' SDPA: the same
outputs, up to the rounding of their sums, in each case where they replace it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from stages.common.kernels.attention import (
    grouped_query_sdpa,
    onednn_masked_attention,
    register_spa_sdpa,
    shared_prefix_attention,
    spa_sdpa,
)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_single_query_attention_equals_transformers_sdpa_under_grouped_heads(mask_kind):
    """The decode-step regrouping (no KV copy) gives transformers' SDPA result: 6 query heads on
    2 key/value heads, a padded batch, one query token; longer queries go to SDPA unchanged."""
    torch.manual_seed(0)
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = 3, True
    key, value = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    keep = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    keep[1, ..., :3] = False  # the second row is left-padded
    mask = {"none": None, "bool": keep,
            "float": torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)}[mask_kind]
    query = torch.randn(2, 6, 1, 8)
    ours, _ = grouped_query_sdpa(module, query, key, value, mask, scaling=0.3)
    stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == stock.shape == (2, 1, 6, 8)
    torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-6)
    long_query = torch.randn(2, 6, 7, 8)
    torch.testing.assert_close(grouped_query_sdpa(module, long_query, key, value, None, scaling=0.3)[0],
                               sdpa_attention_forward(module, long_query, key, value, None, scaling=0.3)[0])


def masked_prefill():
    """A masked multi-token query over cached keys (the hf backend's prefill): 5 cached columns and
    4 new ones, causal within the new tokens, 3 query heads a key head, the second row left-padded.
    Returns (module, query, key, value, keep)."""
    torch.manual_seed(0)
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = 3, True
    key, value = torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    keep = torch.ones(2, 1, 4, 9, dtype=torch.bool).tril(diagonal=5)
    keep[1, ..., :2] = False
    return module, torch.randn(2, 6, 4, 8), key, value, keep


@pytest.mark.parametrize("grad", [False, True])
def test_masked_prefill_attention_equals_transformers_sdpa_under_grouped_heads(grad):
    """A masked multi-token query (the hf backend's prefill over cached keys, causal within the new
    tokens, a padded row) gives transformers' result: through SDPA's grouped heads outside autograd,
    through transformers itself under it."""
    module, query, key, value, keep = masked_prefill()
    with torch.set_grad_enabled(grad):
        ours, _ = grouped_query_sdpa(module, query, key, value, keep, scaling=0.3)
    stock, _ = sdpa_attention_forward(module, query, key, value, keep, scaling=0.3)
    assert ours.shape == stock.shape == (2, 4, 6, 8)
    torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_shared_prefix_attention_equals_transformers_sdpa(mask_kind, dtype):
    """A decode step that reads the columns every row shares once for all rows (row 0's copy),
    each row's own columns under its mask, and merges the two by log-sum-exp gives transformers'
    SDPA result, in the query's dtype: 6 query heads on 2 key/value heads, a row with padding among
    its own columns and one that sees only the shared columns."""
    torch.manual_seed(0)
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = 3, True
    dtype = getattr(torch, dtype)
    key, value = torch.randn(3, 2, 12, 8, dtype=dtype), torch.randn(3, 2, 12, 8, dtype=dtype)
    key[1:, :, :5], value[1:, :, :5] = key[:1, :, :5], value[:1, :, :5]  # 5 shared columns
    keep = torch.ones(3, 1, 1, 12, dtype=torch.bool)
    keep[1, ..., 5:7] = False  # padding between the shared columns and the row's own
    keep[2, ..., 5:] = False  # a row that sees none of its own columns
    mask = keep if mask_kind == "bool" else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    query = torch.randn(3, 6, 1, 8, dtype=dtype)
    ours = shared_prefix_attention(query, key, value, mask, 5, 0.3)
    stock, _ = sdpa_attention_forward(module, query, key, value, keep, scaling=0.3)
    assert ours.shape == stock.shape == (3, 1, 6, 8) and ours.dtype == stock.dtype == dtype
    # Outputs are averages of values of magnitude < 5. In float32 each part's kernel and the
    # merge's exp and log-sum-exp round (eps 1.2e-7): a few ulps of 5. In bfloat16 (eps 7.8e-3)
    # each part's output is rounded before the merge and the result once more: two ulps of 5.
    atol = 5e-6 if dtype == torch.float32 else 0.08
    torch.testing.assert_close(ours, stock, rtol=0, atol=atol)


@pytest.mark.parametrize("kv_heads", [2, 6])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "shared_batch", "strided_keys"])
def test_onednn_masked_attention_equals_transformers_sdpa(kv_heads, mask_kind):
    """A prefill of 4 new tokens over 5 cached columns as oneDNN products, a pair per row and
    key/value head, gives transformers' SDPA result: grouped heads or not, causal among the new
    tokens, a left-padded row, a mask given per row or once for all rows, keys and values strided
    by the heads as a projection's output is; a padding query that may attend to nothing comes
    out finite."""
    torch.manual_seed(0)
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = 6 // kv_heads, True
    key, value = torch.randn(2, kv_heads, 9, 8), torch.randn(2, kv_heads, 9, 8)
    if mask_kind == "strided_keys":  # [rows, columns, heads, dim] seen as [rows, heads, columns, dim]
        key, value = key.transpose(1, 2).contiguous().transpose(1, 2), value.transpose(1, 2).contiguous().transpose(1, 2)
    keep = torch.ones(2, 1, 4, 9, dtype=torch.bool).tril(diagonal=5)
    if mask_kind == "shared_batch":
        keep = keep[:1]
    else:
        keep[1, ..., :6] = False  # row 1: no cached columns, and its first new token is padding
    mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min) if mask_kind == "float" else keep
    query = torch.randn(2, 6, 4, 8)
    ours = onednn_masked_attention(query, key, value, mask, 0.3)
    stock, _ = sdpa_attention_forward(module, query, key, value, keep, scaling=0.3)
    assert ours.shape == stock.shape == (2, 4, 6, 8)
    assert torch.isfinite(ours).all()
    real = keep.expand(2, 1, 4, 9).any(-1)[:, 0]  # [rows, q]: queries that attend to something
    # Averages of values of magnitude < 5 over 9 columns, products and softmax in float32.
    torch.testing.assert_close(ours[real], stock[real], rtol=0, atol=5e-6)


def test_a_prefill_over_cached_keys_without_onednn_is_sdpas(monkeypatch):
    """Under a PyTorch built without oneDNN (its ops missing), spa's SDPA computes a float32 prefill
    over cached keys as SDPA does, not with oneDNN's products: transformers' result."""

    def missing(*args):
        raise RuntimeError("No such operator mkldnn::_linear_pointwise")

    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", missing)
    module, query, key, value, keep = masked_prefill()
    with torch.no_grad():
        ours, _ = spa_sdpa(module, query, key, value, keep, scaling=0.3)
    stock, _ = sdpa_attention_forward(module, query, key, value, keep, scaling=0.3)
    assert ours.shape == stock.shape == (2, 4, 6, 8)
    # Averages of values of magnitude < 5 over 9 columns, in float32 (grouped heads or repeated).
    torch.testing.assert_close(ours, stock, rtol=0, atol=5e-6)


@pytest.mark.parametrize("capability", ["AVX512", "AVX2"])
def test_a_prefill_over_cached_keys_takes_onednn_only_on_avx512(monkeypatch, capability):
    """spa's SDPA computes a float32 prefill over cached keys with oneDNN's products where PyTorch
    runs AVX512 kernels and with SDPA's kernel on an AVX2-only CPU (simulated by the capability
    PyTorch reports); transformers' result either way."""
    from stages.common.kernels import attention

    calls = []

    def spy(*args):
        calls.append(args)
        return onednn_masked_attention(*args)

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(attention, "onednn_masked_attention", spy)
    module, query, key, value, keep = masked_prefill()
    with torch.no_grad():
        ours, _ = spa_sdpa(module, query, key, value, keep, scaling=0.3)
    stock, _ = sdpa_attention_forward(module, query, key, value, keep, scaling=0.3)
    assert len(calls) == (capability == "AVX512")
    # Averages of values of magnitude < 5 over 9 columns, in float32.
    torch.testing.assert_close(ours, stock, rtol=0, atol=5e-6)


def test_grouped_heads_decode_as_with_eager_attention():
    """Greedy decoding of a grouped-query model with "sdpa" as `load_model` sets it up (so through
    `grouped_query_sdpa` where transformers lacks its own fix) produces the tokens and scores of the
    eager attention, which repeats the key/value heads."""
    register_spa_sdpa()
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    prompt = torch.tensor([[0, 0, 5, 9, 14], [3, 7, 11, 4, 8]])
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    runs = {}
    for attn in ("sdpa", "eager"):
        model.set_attn_implementation(attn)
        runs[attn] = model.generate(prompt, attention_mask=attention, max_new_tokens=12, do_sample=False,
                                    output_scores=True, return_dict_in_generate=True, eos_token_id=None)
    assert torch.equal(runs["sdpa"].sequences, runs["eager"].sequences)
    torch.testing.assert_close(torch.stack(runs["sdpa"].scores), torch.stack(runs["eager"].scores),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("context", "length", "kv_heads"), [(300, 270, 2), (7, 5, 6), (300, 1, 2), (1, 9, 2)])
def test_context_then_causal_attention_equals_the_masked_softmax(dtype, context, length, kv_heads):
    """A tree node's queries over its ancestors' keys (all seen) and its own (causally): outputs and
    the gradients of queries, keys and values against SDPA in float64 under the dense mask, on the
    same (rounded) inputs, 6 query heads."""
    from stages.common.kernels.attention import context_then_causal_attention

    torch.manual_seed(0)
    dtype = getattr(torch, dtype)
    query = torch.rand(1, 6, length, 16, dtype=dtype) * 2 - 1  # |x| <= 1: every output and term is O(1)
    key, value = (torch.rand(1, kv_heads, context + length, 16, dtype=dtype) * 2 - 1 for _ in range(2))
    weights = torch.rand(1, 6, length, 16, dtype=dtype) * 2 - 1
    inputs = [x.requires_grad_() for x in (query, key, value)]
    ours = context_then_causal_attention(query, key[:, :, context:], value[:, :, context:], key[:, :, :context],
                                         value[:, :, :context], 0.5)
    ours_grads = torch.autograd.grad(ours, inputs, weights)
    exact = [x.detach().double().requires_grad_() for x in inputs]
    mask = torch.arange(context + length)[None, :] <= torch.arange(context, context + length)[:, None]
    stock = torch.nn.functional.scaled_dot_product_attention(*exact, attn_mask=mask, scale=0.5, enable_gqa=True)
    stock_grads = torch.autograd.grad(stock, exact, weights.double())
    # float32: sums of up to 570 terms, each rounded (eps 1.2e-7), error ~sqrt(570) eps << 1e-5 of
    # the result's norm. bfloat16 (eps 7.8e-3): each kernel product rounds its two operands and its
    # result (3 half-ulps), the merge its result once more: 4 half-ulps, 2 eps of the norm.
    bound = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(torch.bfloat16).eps
    assert ours.dtype == dtype and ours.shape == stock.shape
    for name, a, b in zip(["out", "query", "key", "value"], [ours, *ours_grads], [stock, *stock_grads], strict=True):
        error = (a.double() - b).norm() / b.norm()
        assert error <= bound, f"{name}: relative error {error:.2e} > {bound:.2e}"


def test_context_then_causal_attention_under_autocast_computes_in_its_dtype():
    """Under the CPU's bf16 autocast (`model.dtype: bfloat16` training), inputs of mixed dtypes (the
    rotary embedding leaves queries and keys in float32, values in bf16) are cast as autocast casts
    SDPA's: the result is the kernel's on the bf16 inputs, exactly."""
    from stages.common.kernels.attention import context_then_causal_attention

    torch.manual_seed(0)
    query, key = torch.randn(1, 6, 5, 16), torch.randn(1, 2, 12, 16)
    value = torch.randn(1, 2, 12, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = context_then_causal_attention(query, key[:, :, 7:], value[:, :, 7:], key[:, :, :7], value[:, :, :7], 0.5)
    cast = context_then_causal_attention(query.bfloat16(), key[:, :, 7:].bfloat16(), value[:, :, 7:],
                                         key[:, :, :7].bfloat16(), value[:, :, :7], 0.5)
    assert mixed.dtype == torch.bfloat16 and torch.equal(mixed, cast)
