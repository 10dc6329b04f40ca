"""One decode step against its kernels: the engine's eager step, and the same step compiled.

`bench/profile_generate.py` finds the engine's decode steps spending 18-29% of their time outside
the products and attention kernels (`KERNELS`): a layer's other operators (norms, rotary
embeddings, cache writes, residual sums, the MLP's gate) and Python between them. This times the
bundled model's decode step alone at a fixed shape: ``--rows`` rows over ``--columns`` cached
columns of random tokens, the first ``--shared`` of them common to every row as the hf backend
lays them out, ``--steps`` steps each appending a column, the median of ``--reps`` rounds (the
arms taking turns round by round):

* ``eager``: `stages.common.kernels.decode.DecodeStep` on the hf backend's slab cache inside
  `PackedLinears.active`: the engine's decode step;
* ``kernels``: the kernels' self time in that step, under `torch.profiler`;
* ``compiled`` (``--compile``): the same arithmetic written as one function over the slabs and
  compiled by torch.compile's CPU backend (inductor, dynamic shapes, its C++ wrapper): the
  products (oneDNN's, on the same packed weights) and the native attention kernel are opaque
  custom ops, and everything between them is fused into generated C++ loops with no Python
  between operators. Its compile seconds (from an empty compile cache) are printed, and its
  logits' largest difference from the eager step's on the same cache beside the logits' largest
  magnitude.

The compiled step is a yardstick, not a path the engine takes: it says how much of the time
outside the kernels is the operators and Python between them (which compiling removes) and how
much is the work itself. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from profile_generate import KERNELS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--columns", type=int, default=700, help="cached columns before the first step")
    parser.add_argument("--shared", type=int, default=400, help="of them, the columns every row shares")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--compile", action="store_true", help="also time the step compiled by torch.compile")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="spa-inductor-") as inductor_cache:
        # An empty compile cache, so compile_s is a first compile's, as on a user's first run.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache
        print(json.dumps(measure(args)))


def measure(args) -> dict:
    import torch

    from stages.common.config import load_config
    from stages.common.kernels.decode import DecodeStep
    from stages.common.kernels.linear import PackedLinears
    from stages.common.models import load_model

    config = load_config(None, ["model.name=smollm2-135m", f"model.dtype={args.dtype}", "quiet=true"])
    model, _ = load_model(config.model, device="cpu")
    model.eval()
    torch.manual_seed(0)
    caches = SlabCaches(model, args.rows, args.columns + args.steps + 1, args.columns, args.shared)
    tokens = torch.randint(100, 10000, (args.rows, 1))
    step = DecodeStep(model)
    linears = PackedLinears(model)
    result = {"rows": args.rows, "columns": args.columns, "shared_columns": args.shared, "dtype": args.dtype}
    with torch.inference_mode(), linears.active():
        def eager(cache):
            column = cache.layers[0].length
            return step(tokens, torch.full((args.rows, 1), column), cache, caches.mask(column), args.shared)

        arms = {"eager": eager}
        if args.compile:
            arms["compiled"], result["compile_s"] = compiled_step(model, linears, caches, tokens, args)
        result.update({f"{name}_ms": ms for name, ms in timed(arms, caches, args).items()})
        result["kernels_ms"] = kernel_ms(eager, caches, args)
        for name in arms:
            result[f"{name}_kernel_share"] = round(result["kernels_ms"] / result[f"{name}_ms"], 3)
        if args.compile:
            compiled = arms["compiled"]
            first, second = caches.new(), caches.new()
            reference = eager(first)
            result["compiled_max_abs_diff"] = (reference - compiled(second)).abs().max().item()
            result["logits_max_abs"] = reference.abs().max().item()
            from torch._dynamo.utils import counters

            result["compiled_graphs"] = counters["stats"]["unique_graphs"]  # 1: no step recompiled
    return result


class SlabCaches:
    """Fresh copies of one slab cache (the hf backend's layout), filled by the model's own prefill of
    random tokens, the first `shared` the same in every row (their keys and values then taken from
    row 0, as the engine reads them): `new()` for each round."""

    def __init__(self, model, rows: int, capacity: int, filled: int, shared: int):
        import torch
        from transformers import DynamicCache

        tokens = torch.randint(100, 10000, (rows, filled))
        tokens[:, :shared] = tokens[0, :shared]
        prefill = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=tokens, past_key_values=prefill, use_cache=True, logits_to_keep=1)
        self.keys, self.values = [], []
        for layer in prefill.layers:
            for filled_part, slabs in ((layer.keys, self.keys), (layer.values, self.values)):
                slab = filled_part.new_zeros(*filled_part.shape[:2], capacity, filled_part.shape[-1])
                slab[:, :, :filled] = filled_part
                slab[1:, :, :shared] = slab[:1, :, :shared]
                slabs.append(slab)
        self.filled, self.shared = filled, shared
        self.valid = torch.ones(rows, capacity, dtype=torch.bool)

    def new(self):
        from stages.agent.backends.hf import _SlabCache, _SlabLayer

        layers = [_SlabLayer(k.clone(), v.clone(), self.filled) for k, v in zip(self.keys, self.values)]
        return _SlabCache(layers, self.shared)

    def mask(self, column: int):
        """The boolean mask of a step writing `column`, as the hf backend passes it."""
        return self.valid[:, None, None, :column + 1]


def timed(arms: dict, caches: SlabCaches, args) -> dict[str, float]:
    """Each arm's median milliseconds a step over `args.reps` rounds of `args.steps` steps, after one
    round each; the arms take turns round by round, so the machine's drift falls on all of them."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.reps + 1):
        for name, run in arms.items():
            cache = caches.new()
            start = time.perf_counter()
            for _ in range(args.steps):
                run(cache)
            times[name].append((time.perf_counter() - start) / args.steps * 1000)
    return {name: round(statistics.median(ms[1:]), 2) for name, ms in times.items()}


def kernel_ms(run, caches: SlabCaches, args) -> float:
    """The kernels' self milliseconds a step, over one profiled round."""
    from torch.profiler import ProfilerActivity, profile

    cache = caches.new()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            run(cache)
    us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in KERNELS)
    return round(us / 1000 / args.steps, 2)


def compiled_step(model, linears, caches: SlabCaches, tokens, args):
    """The decode step as one function over the slabs, compiled; returns (step, compile seconds)."""
    import torch
    import torch._inductor.config as inductor
    import torch.nn.functional as F

    from stages.common.kernels import native
    from stages.common.kernels.decode import _rms_norm, _rotated  # the eager step's own norm and rotation

    # Schemas spelled out: this module's annotations are strings (`from __future__ import annotations`).
    @torch.library.custom_op("spa_bench::linear", mutates_args=(),
                             schema="(Tensor x, Tensor weight) -> Tensor")
    def linear(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")

    @linear.register_fake
    def _(x, weight):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.custom_op("spa_bench::attention", mutates_args=(),
                             schema="(Tensor query, Tensor key, Tensor value, Tensor mask, SymInt shared, "
                                    "float scale) -> Tensor")
    def attention(query, key, value, mask, shared, scale):
        return native.decode_attention(query, key, value, mask, shared, scale)

    @attention.register_fake
    def _(query, key, value, mask, shared, scale):
        return query.new_empty(query.shape[0], 1, query.shape[1], query.shape[3])

    inner, config = model.model, model.config
    if not native.available() or any(m.bias is not None for group in linears._packed for m in group):
        raise SystemExit("--compile needs the native attention kernel and a model without linear biases")
    packed = {group[0]: weight for group, weight in linears._packed.items()}
    layers = list(inner.layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim, width = config.hidden_size // heads, config.intermediate_size
    half, scale = head_dim // 2, layers[0].self_attn.scaling

    def step(token, position, valid, keys: list[torch.Tensor], values: list[torch.Tensor], column: int):
        rows = token.shape[0]
        x = inner.embed_tokens(token)
        cos, sin = inner.rotary_emb(x, position)
        cos, signed_sin = cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), -1)[:, None]
        mask = torch.zeros(valid.shape, dtype=x.dtype).masked_fill_(~valid, float("-inf"))
        for index, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = linear(_rms_norm(x, layer.input_layernorm), packed[attn.q_proj]).split(
                [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
            q, k = (t.view(rows, -1, 1, head_dim) for t in (q, k))
            q = _rotated(q, cos, signed_sin, half)
            keys[index][:, :, column:column + 1] = _rotated(k, cos, signed_sin, half)
            values[index][:, :, column:column + 1] = v.view(rows, -1, 1, head_dim)
            out = attention(q, keys[index][:, :, :column + 1], values[index][:, :, :column + 1], mask,
                            caches.shared, scale)
            x = x + linear(out.reshape(rows, 1, -1), packed[attn.o_proj])
            h = _rms_norm(x, layer.post_attention_layernorm)
            gate, up = linear(h, packed[mlp.gate_proj]).split([width, width], -1)
            x = x + linear(F.silu(gate) * up, packed[mlp.down_proj])
        return linear(_rms_norm(x, inner.norm), packed[model.lm_head])[:, -1]

    inductor.cpp_wrapper = True
    inductor.compile_threads = 1  # no pool of compiling processes left beside the timed steps
    compiled = torch.compile(step, dynamic=True)

    def run(cache):
        column = cache.layers[0].length
        keys, values = [layer.k_slab for layer in cache.layers], [layer.v_slab for layer in cache.layers]
        position = torch.full((args.rows, 1), column)
        logits = compiled(tokens, position, caches.mask(column), keys, values, column)
        for layer in cache.layers:
            layer._set_length(column + 1)
        return logits

    start = time.perf_counter()
    cache = caches.new()
    for _ in range(3):  # the first call compiles, a later one any recompiling a new column asks for
        run(cache)
    return run, round(time.perf_counter() - start, 1)


if __name__ == "__main__":
    main()
