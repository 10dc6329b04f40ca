"""Where one `spa sft` optimizer step's time goes, on the CPU: data, forward, backward, optimizer.

The step is `spa sft`'s own (`stages.sft._train_step`'s parts: `step_plan` and `collate` from
`stages.training.sft_data`, `token_ce_sum`, the engine's backward and step), on SmolLM2-135M and
the multi-turn Sokoban rows of `bench_sft.py` (one row per trajectory), or the rows of an SFT file
(`--data`, e.g. a demo run's `runs/demo/sft_data/selfplay.jsonl`), `--rows-per-step` rows a step,
with `sft.gradient_checkpointing` where `--gradient-checkpointing` says so (the demo's). Each
variant runs in a fresh interpreter: one warm-up step (DeepSpeed's and the allocator's first-use
costs, Adam's state), then one step timed phase by phase and profiled with
`torch.profiler`, whose operator times split the forward and backward into

* ``matmul``: the linear layers and the LM head (``aten::mm``, ``addmm``, ``bmm``, and oneDNN's
  ``mkldnn::_linear_pointwise``, which computes them in fp32 training);
* ``attention``: SDPA's kernels, forward and backward;
* ``loss``: the log-softmax over the vocabulary at the trained positions and the gather of the
  targets' log-probs, forward and backward;
* ``copies``: casts, concatenations and gathers (autocast's bf16 copies of the weights among them);
* ``other``: the rest (norms, activations, the loss, DeepSpeed's gradient hooks).

Variants: precision (fp32; bf16 = fp32 weights under bf16 autocast) x engine (DeepSpeed ZeRO-2,
`sft.zero_stage=2`, or plain torch, `sft.zero_stage=0`, what ``auto`` picks for one CPU process) x
prefix sharing (`sft.share_prefix`). A shared step on plain torch trains its micro-batches node by
node, as `spa sft` does there (`stages.training.tree_passes`): forward and backward passes
interleave, and their time is the phase ``node_passes``.
Prints one JSON object: per variant the phases' seconds, the profile's split, the tokens the rows
hold and the tokens computed, the rate of the linear layers' matmuls inside the step (their FLOPs:
6 x the weights of the layers x the tokens they see, 8 x with the recomputed forward, the LM head
on the trained tokens only, over the profile's matmul time), MFU (6 x parameters x computed tokens
/ step time, over the run's matmul peak in that precision, as `bench_sft.py`) and the peak RSS;
with ``--allocated``, the step is run once more with every allocation of torch's allocator
recorded, and its peak (`stages.training.memory.measured_peak_bytes`: the weights counted, not
the optimizer's state, which the warm-up step created) is ``allocated_peak_gb``. A
profile beside the benchmarks, not one of `make bench`: its figures are in docs/results.md.

    python bench/profile_sft_step.py [--model smollm2-135m] [--rows-per-step 2] [--data SFT.jsonl]
        [--gradient-checkpointing] [--dtype float32 --dtype bfloat16]
        [--variant z2_shared --variant z2_unshared --variant z0_unshared] [--allocated]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = {"z2_shared": (2, True), "z2_unshared": (2, False), "z0_shared": (0, True), "z0_unshared": (0, False)}
CATEGORIES = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"),
              "attention": ("scaled_dot_product", "flash_attention"),
              "loss": ("aten::_log_softmax", "aten::gather", "aten::scatter"),
              "copies": ("aten::_to_copy", "aten::copy_", "aten::cat", "aten::index_select", "aten::clone")}


def category(op: str) -> str:
    return next((name for name, marks in CATEGORIES.items() if any(op.startswith(m) or m in op for m in marks)),
                "other")


def measure(model: str, data: str, rows_per_step: int, dtype: str, stage: int, share: bool,
            checkpointing: bool, allocated: bool = False) -> dict:
    """One variant's timed and profiled step (see the module docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from stages.common.config import load_config
    from stages.sft import token_ce_sum
    from stages.training import engine as eng
    from stages.training import memory, trainable, tree_passes
    from stages.training.policy import StepPolicy
    from stages.training.sft_data import collate, rank_micro_batches, read_rows, step_plan, tokenize_rows

    config = load_config(None, [], {"model.name": model, "model.dtype": dtype, "sft.zero_stage": stage,
                                    "quiet": True})
    cfg = config.sft
    dist = trainable.start_processes(config.model, stage)
    model, tokenizer, mixed = trainable.load_trainable(config.model, dist, zero_stage=stage, seed=cfg.seed,
                                                       gradient_checkpointing=checkpointing)
    engine = trainable.make_engine(StepPolicy(model, temperature=1.0), dist, mixed, stage, eng.OptimSettings(
        cfg.lr, tuple(cfg.betas), cfg.weight_decay, cfg.grad_clip, 10, cfg.warmup_ratio), False, "")
    examples = tokenize_rows(read_rows(data), tokenizer, cfg.max_length)[0]
    params = sum(p.numel() for p in model.parameters())
    by_node = share and tree_passes.applies(dist.device, stage, checkpointing, model.config)  # as spa sft
    engine.module.train()

    def step(rows: list) -> dict:
        seconds = dict.fromkeys(("plan", "collate", "forward", "backward", "node_passes", "optimizer"), 0.0)
        clock = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            seconds[phase] += now - clock
            clock = now

        plan = step_plan(rows, 1, cfg.micro_batch_tokens, False, share)
        micro = rank_micro_batches(rows, 0, 1, cfg.micro_batch_tokens, False, share)
        trained = sum(row.trained for row in rows)
        lap("plan")
        for i, mb in enumerate(micro):
            if by_node:
                examples_of = [rows[u] for u in mb.rows]
                tree_passes.backward(engine, examples_of, lambda r: torch.full(r.shape, 1.0 / trained), mb.weight)
                lap("node_passes")
                continue
            batch = collate([rows[u] for u in mb.rows], dist.device, share)
            lap("collate")
            ce = token_ce_sum(engine, batch)
            lap("forward")
            engine.backward(ce * (mb.weight / trained), last=i == len(micro) - 1)
            lap("backward")
        engine.step()
        lap("optimizer")
        return {"seconds": {k: round(v, 3) for k, v in seconds.items()}, "step_s": round(sum(seconds.values()), 3),
                "tokens": sum(len(r) for r in rows), "computed_tokens": sum(mb.tokens for p in plan for mb in p),
                "trained_tokens": trained, "micro_batches": len(micro)}

    step(examples[rows_per_step:2 * rows_per_step])  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed = step(examples[:rows_per_step])
    split: dict[str, float] = {}
    for event in prof.key_averages():
        split[category(event.key)] = split.get(category(event.key), 0.0) + event.self_cpu_time_total / 1e6
    head = model.get_output_embeddings().weight.numel()  # the LM head runs on the trained tokens only
    body = params - model.get_input_embeddings().weight.numel() - (head if not model.config.tie_word_embeddings else 0)
    passes = 8 if checkpointing else 6  # forward and backward, and the forward again when recomputed
    matmul_flops = passes * body * timed["computed_tokens"] + 6 * head * timed["trained_tokens"]
    result = {**timed, "profile_s": {k: round(v, 3) for k, v in sorted(split.items())},
              "parameters": params,
              "matmul_gflops_in_step": round(matmul_flops / split.get("matmul", float("inf")) / 1e9, 1),
              "flops_per_s": 6 * params * timed["computed_tokens"] / timed["step_s"],
              "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3)}
    if allocated:  # the same rows' step again, every allocation recorded (after the RSS is read)
        peak = memory.measured_peak_bytes(lambda: step(examples[:rows_per_step]), [engine.module])
        result["allocated_peak_gb"] = round(peak / 1e9, 3)
    return result


def run_child(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows-per-step", type=int, default=2)
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"))
    parser.add_argument("--variant", action="append", choices=tuple(VARIANTS))
    parser.add_argument("--data", help="an SFT JSONL file (spa clean's) instead of bench_sft.py's Sokoban rows")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="as sft.gradient_checkpointing")
    parser.add_argument("--allocated", action="store_true",
                        help="also the step's peak in torch's allocator (the step again, allocations recorded)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        kind = spec.pop("kind")
        from bench_sft import matmul_peak

        print(json.dumps(measure(**spec) if kind == "step" else {"flops": matmul_peak(spec["dtype"])}))
        return

    from bench_sft import make_data

    work = Path(tempfile.mkdtemp(prefix="bench-sft-step-"))
    data = args.data or str(make_data(work, rows=2 * args.rows_per_step + 2))
    result: dict = {"model": args.model, "rows_per_step": args.rows_per_step, "data": data,
                    "gradient_checkpointing": args.gradient_checkpointing, "device": "cpu"}
    for dtype in args.dtype or ["float32", "bfloat16"]:
        peak = run_child({"kind": "peak", "dtype": dtype})["flops"]
        runs = {"matmul_peak_gflops": round(peak / 1e9, 1)}
        for name in args.variant or ["z2_shared", "z2_unshared", "z0_unshared"]:
            stage, share = VARIANTS[name]
            run = run_child({"kind": "step", "model": args.model, "data": data, "rows_per_step": args.rows_per_step, "dtype": dtype,
                             "stage": stage, "share": share, "checkpointing": args.gradient_checkpointing,
                             "allocated": args.allocated})
            if "flops_per_s" in run:
                run["mfu"] = round(run.pop("flops_per_s") / peak, 3)
                run["tokens_per_s"] = round(run["tokens"] / run["step_s"], 1)
            runs[name] = run
        result[dtype] = runs
    print(json.dumps(result))


if __name__ == "__main__":
    main()
