"""Where the hf engine's rollout time goes: PyTorch operators by self time, prefill and decode apart.

Plays `bench/bench_generate.py`'s episodes (Sokoban, world-model prompt, 2 turns of up to 96 new
tokens, the bundled SmolLM2-135M in float32, or in ``--dtype bfloat16``) once under
`torch.profiler`, with every prefill (`HFBackend._prefill`) marked; each operator's self time counts
for the prefill when it starts inside one, else for decoding (the decode steps' forwards, sampling,
bookkeeping). ``--stock`` runs the linear layers on PyTorch's own kernels instead of oneDNN's
(`stages.common.kernels.linear`). The profiler's own overhead inflates the many small operators, so
the wall times printed beside come from the backend's counters in the same run, and the shares are
what to read; ``operator_seconds`` sums the operators' self times, so the phase's wall time less it
is Python and the framework between operators (inflated by the profiler too).

``kernel_seconds`` sums, per phase, the self times of the products and attention kernels
(`KERNELS`): the operators that read the weights and the KV cache and do the arithmetic (the
linear layers on oneDNN's products, the fastest PyTorch has for these shapes here: docs/results.md).
``kernel_bound_tokens_per_s`` is the tokens generated over both phases' kernel seconds: the rate
of an engine that ran the same kernels with no other operator, no Python and no framework between
them, the ceiling of any engine built from them. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: The operators that do the model's arithmetic: the linear layers (oneDNN's, or PyTorch's BLAS with
#: --stock), the attention over the KV cache (the native kernel, `stages.common.kernels.native`,
#: marked with its own profiler ranges; where it does not run, the batched products of the own
#: columns' attention) and SDPA's kernel.
KERNELS = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm", "spa::decode_attention",
           "spa::prefill_attention", "aten::_scaled_dot_product_flash_attention_for_cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="episodes, all live at once")
    parser.add_argument("--stock", action="store_true", help="PyTorch's own kernels for the linear layers")
    parser.add_argument("--top", type=int, default=8, help="operators listed per phase")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype (bench_generate's engine and engine_bf16)")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from stages.agent.backends import make_backend
    from stages.agent.backends.hf import HFBackend
    from stages.agent.proxy import play
    from stages.common.config import load_config
    from stages.common.kernels import linear

    linear.enabled = not args.stock
    config = load_config(None, [
        "env.name=sokoban", "rollout.max_turns=2", "rollout.backend=hf", "rollout.max_new_tokens=96",
        f"rollout.batch_size={args.batch}", "model.name=smollm2-135m", f"model.dtype={args.dtype}", "quiet=true"])
    modes = {"prompt_mode": "world_model", "render_mode": "coords"}
    backend = make_backend(config.model, config.rollout, prompt_mode=modes["prompt_mode"])
    warmup = load_config(None, ["env.name=sokoban", "rollout.max_turns=1", "rollout.max_new_tokens=4"])
    play(warmup.env, warmup.rollout, backend, [0], 1, **modes)
    backend.reset()
    backend.reset_stats()

    prefill = HFBackend._prefill

    def marked_prefill(self, *a, **k):
        with record_function("spa_prefill"):
            return prefill(self, *a, **k)

    HFBackend._prefill = marked_prefill
    seeds = range(config.rollout.seed, config.rollout.seed + args.batch // 2)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        played = play(config.env, config.rollout, backend, seeds, 2, **modes)
    seconds = time.perf_counter() - start
    HFBackend._prefill = prefill

    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "spa_prefill")
    starts = [s for s, _ in spans]
    self_us: dict[str, dict[str, float]] = {"prefill": defaultdict(float), "decode": defaultdict(float)}
    for e in events:
        if e.name == "spa_prefill" or not e.name.startswith(("aten::", "mkldnn::", "spa::")):
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        phase = "prefill" if i >= 0 and e.time_range.start < spans[i][1] else "decode"
        self_us[phase][e.name] += e.self_cpu_time_total
    stats = backend.stats
    result = {"batch": args.batch, "dtype": args.dtype, "linear_kernels": "pytorch" if args.stock else "onednn",
              "generated_tokens": sum(sum(e.response_mask) for e in played), "seconds_profiled": round(seconds, 2),
              "prefilled_tokens": stats["prefilled_tokens"], "decode_steps": stats["decode_steps"]}
    kernel_us = {phase: sum(ops.get(name, 0.0) for name in KERNELS) for phase, ops in self_us.items()}
    for phase, ops in self_us.items():
        total = sum(ops.values())
        top = sorted(ops.items(), key=lambda kv: -kv[1])[:args.top]
        result[phase] = {"seconds": round(stats[f"{phase}_s"], 2), "operator_seconds": round(total / 1e6, 2),
                         "kernel_seconds": round(kernel_us[phase] / 1e6, 2),
                         "op_share": {name: round(us / total, 3) for name, us in top}}
    result["kernel_bound_tokens_per_s"] = round(result["generated_tokens"] / (sum(kernel_us.values()) / 1e6), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
