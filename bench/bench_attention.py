"""The hf engine's attention kernels on a CPU against SDPA's, at the shapes of bench_generate's rollouts.

SmolLM2-135M's attention (9 query heads on 3 key/value heads of 64), float32 (or ``--dtype
bfloat16``), random tensors, 30 calls a measurement, one per layer, each over its layer's own keys
and values (read from memory, as a forward reads them), as a decode step or a prefill forward makes
them:

* ``decode``: one new token a row over the KV cache, whose first ``--shared`` columns (the
  instruction) are the same in every row and the next ``--own`` are each row's own. ``sdpa`` is
  SDPA's CPU kernel on the query heads regrouped per key/value head (`grouped_query_sdpa`'s decode
  path), reading every row's copy of the shared columns; ``shared_prefix`` is
  `stages.common.kernels.attention.shared_prefix_attention` in PyTorch's operators, which reads them
  once for all rows and each row's own columns with `own_columns_attention`; ``native`` is the one
  C kernel the engine runs instead where it can (`stages.common.kernels.native.decode_attention`),
  given the additive mask `DecodeStep` makes once a step. In bfloat16 on a CPU with AVX512-BF16,
  ``native_widened`` is that kernel with its scores computed by widening each key to float32 instead
  of by the dot products it uses there (`stages.common.kernels.native.bf16_dots`), in both calls.
* ``prefill``: ``--new`` new tokens a row, causal among themselves, over ``--cached`` columns, a
  padded row mask (the second turn's prefill of a 16-episode run). ``sdpa`` is SDPA's CPU kernel
  with grouped heads (`grouped_query_sdpa`'s masked path); ``onednn`` is
  `stages.common.kernels.attention.onednn_masked_attention` (float32 only); ``native`` the C kernel
  (`stages.common.kernels.native.prefill_attention`).

* ``tree``: training attention, forward and backward, of ``--tree-rows`` rows that begin with the
  same ``--tree-root`` tokens and go on with ``--tree-child`` tokens of their own (SFT's rows under
  one system prompt). ``rows_sdpa`` is each row alone, SDPA's causal kernel over its whole length
  (`sft.share_prefix=false`); ``tree`` is the prefix tree node by node as `spa sft` trains it on a
  CPU (`stages.training.tree_passes`): the root causally, then each child over the root's keys
  and its own (`stages.common.kernels.attention.context_then_causal_attention`).

Each figure is the median of ``--reps`` measurements, milliseconds for the 30 calls; ``max_abs_diff``
is the largest difference between a variant's output and SDPA's (float32 rounding; in bfloat16,
each rounded to bfloat16). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def timed(function, reps: int) -> float:
    """Median milliseconds of `function` called for each of the ``LAYERS`` layers, after one
    warm-up round."""
    for layer in range(LAYERS):
        function(layer)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for layer in range(LAYERS):
            function(layer)
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 2)


def widened(native_kernel, sdpa, reps: int, dtype) -> dict:
    """Where the native kernel computes a bfloat16 model's scores by AVX512-BF16's dot products, the
    same kernel with them widening each key to float32 instead (``native_widened_ms``)."""
    import torch

    from stages.common.kernels import native

    if not native.bf16_dots() or dtype != torch.bfloat16:
        return {}
    native.bf16_dots_enabled = False
    try:
        return {"native_widened_ms": timed(native_kernel, reps),
                "native_widened_max_abs_diff": (native_kernel(0) - sdpa(0)).abs().max().item()}
    finally:
        native.bf16_dots_enabled = True


def decode(rows: int, shared: int, own: int, reps: int, dtype) -> dict:
    import torch
    import torch.nn.functional as F

    from stages.common.kernels import native
    from stages.common.kernels.attention import shared_prefix_attention

    columns = shared + own
    keys = torch.randn(LAYERS, rows, KV_HEADS, columns, HEAD_DIM, dtype=dtype)
    values = torch.randn(LAYERS, rows, KV_HEADS, columns, HEAD_DIM, dtype=dtype)
    keys[:, 1:, :, :shared], values[:, 1:, :, :shared] = keys[:, :1, :, :shared], values[:, :1, :, :shared]
    mask = torch.ones(rows, 1, 1, columns, dtype=torch.bool)
    mask[::2, ..., shared:shared + 16] = False  # padding in half the rows
    query = torch.randn(rows, HEADS, 1, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM ** -0.5

    def sdpa(layer):
        grouped = query.reshape(rows, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        out = F.scaled_dot_product_attention(grouped, keys[layer], values[layer], attn_mask=mask, scale=scale)
        return out.reshape(rows, 1, HEADS, HEAD_DIM)

    def shared_prefix(layer):
        native.enabled = False
        try:
            return shared_prefix_attention(query, keys[layer], values[layer], mask, shared, scale)
        finally:
            native.enabled = True

    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))  # as `DecodeStep` passes it

    def native_kernel(layer):
        return native.decode_attention(query, keys[layer], values[layer], additive, shared, scale)

    result = {"rows": rows, "shared_columns": shared, "own_columns": own, "sdpa_ms": timed(sdpa, reps),
              "shared_prefix_ms": timed(shared_prefix, reps),
              "max_abs_diff": (shared_prefix(0) - sdpa(0)).abs().max().item()}
    if native.available():
        result.update(native_ms=timed(native_kernel, reps),
                      native_max_abs_diff=(native_kernel(0) - sdpa(0)).abs().max().item(),
                      **widened(native_kernel, sdpa, reps, dtype))
    return result


def prefill(rows: int, new: int, cached: int, reps: int, dtype) -> dict:
    import torch
    import torch.nn.functional as F

    from stages.common.kernels import native
    from stages.common.kernels.attention import onednn_masked_attention

    columns = cached + new
    keys = torch.randn(LAYERS, rows, KV_HEADS, columns, HEAD_DIM, dtype=dtype)
    values = torch.randn(LAYERS, rows, KV_HEADS, columns, HEAD_DIM, dtype=dtype)
    mask = torch.ones(columns, columns, dtype=torch.bool).tril()[-new:].expand(rows, 1, new, columns).clone()
    for row in range(rows):
        mask[row, ..., cached - 5 * row:cached] = False  # each row's own padding
    query = torch.randn(rows, HEADS, new, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM ** -0.5

    def sdpa(layer):
        out = F.scaled_dot_product_attention(query, keys[layer], values[layer], attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2)

    def onednn(layer):
        return onednn_masked_attention(query, keys[layer], values[layer], mask, scale)

    def native_kernel(layer):
        return native.prefill_attention(query, keys[layer], values[layer], mask, scale)

    result = {"rows": rows, "new_tokens": new, "cached_columns": cached, "sdpa_ms": timed(sdpa, reps)}
    if dtype == torch.float32:
        result.update(onednn_ms=timed(onednn, reps), max_abs_diff=(onednn(0) - sdpa(0)).abs().max().item())
    if native.available():
        result.update(native_ms=timed(native_kernel, reps),
                      native_max_abs_diff=(native_kernel(0) - sdpa(0)).abs().max().item(),
                      **widened(native_kernel, sdpa, reps, dtype))
    return result


def tree(rows: int, root: int, child: int, reps: int, dtype) -> dict:
    import torch
    import torch.nn.functional as F

    from stages.common.kernels.attention import context_then_causal_attention

    def inputs(queries: int, keys: int) -> list:
        shapes = [(1, HEADS, queries, HEAD_DIM), (1, KV_HEADS, keys, HEAD_DIM), (1, KV_HEADS, keys, HEAD_DIM)]
        return [torch.randn(shape, dtype=dtype, requires_grad=True) for shape in shapes]

    # Per layer: a row alone (root + child tokens), the root, and a child after the root's keys.
    whole, alone, child_of = ([inputs(n, k) for _ in range(LAYERS)]
                              for n, k in ((root + child, root + child), (root, root), (child, root + child)))
    grad_whole = torch.randn(1, HEADS, root + child, HEAD_DIM, dtype=dtype)
    grad_root, grad_child = grad_whole[:, :, :root], grad_whole[:, :, root:]
    scale = HEAD_DIM ** -0.5

    def rows_sdpa(layer):
        q, k, v = whole[layer]
        for _ in range(rows):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).backward(grad_whole)

    def nodes(layer):
        q, k, v = alone[layer]
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).backward(grad_root)
        q, k, v = child_of[layer]
        for _ in range(rows):
            context_then_causal_attention(q, k[:, :, root:], v[:, :, root:], k[:, :, :root], v[:, :, :root],
                                          scale).backward(grad_child)

    return {"rows": rows, "root_tokens": root, "child_tokens": child, "rows_sdpa_ms": timed(rows_sdpa, reps),
            "tree_ms": timed(nodes, reps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,64", help="decode rows, comma-separated")
    parser.add_argument("--shared", type=int, default=404, help="decode: columns every row shares")
    parser.add_argument("--own", type=int, default=350, help="decode: each row's own columns")
    parser.add_argument("--new", type=int, default=170, help="prefill: new tokens a row")
    parser.add_argument("--cached", type=int, default=642, help="prefill: cached columns a row")
    parser.add_argument("--prefill-rows", type=int, default=16)
    parser.add_argument("--tree-rows", type=int, default=4, help="tree: rows that share the root")
    parser.add_argument("--tree-root", type=int, default=404, help="tree: the tokens the rows share")
    parser.add_argument("--tree-child", type=int, default=611, help="tree: each row's own tokens")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    import torch

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    result = {"threads": torch.get_num_threads(), "dtype": args.dtype,
              "decode": [decode(int(rows), args.shared, args.own, args.reps, dtype) for rows in args.rows.split(",")],
              "prefill": prefill(args.prefill_rows, args.new, args.cached, args.reps, dtype),
              "tree": tree(args.tree_rows, args.tree_root, args.tree_child, args.reps, dtype)}
    for entry in result["decode"]:
        entry["speedup"] = round(entry["sdpa_ms"] / entry["shared_prefix_ms"], 2)
        if "native_ms" in entry:
            entry["native_speedup"] = round(entry["sdpa_ms"] / entry["native_ms"], 2)
    filled = result["prefill"]
    for name in ("onednn", "native"):
        if f"{name}_ms" in filled:
            filled[f"{name}_speedup"] = round(filled["sdpa_ms"] / filled[f"{name}_ms"], 2)
    result["tree"]["speedup"] = round(result["tree"]["rows_sdpa_ms"] / result["tree"]["tree_ms"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
