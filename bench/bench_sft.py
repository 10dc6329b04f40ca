"""Training throughput of `spa sft` against TRL's `SFTTrainer`, on one machine, in one run.

Same model (the bundled SmolLM2-135M-Instruct, full fine-tune, SDPA), same data (multi-turn
Sokoban rows made by `spa generate --backend random` + `spa clean`, ~1,100-1,800 tokens each; a
built-in generator of the same layout if those stages fail), same objective (loss on the assistant
turns only; TRL gets the bundled ChatML template with `{% generation %}` tags, which renders the
same text), same optimizer settings and rows per optimizer step. Every trainer runs in its own subprocess; the first optimizer step is warm-up and is not
timed. Prints one JSON object:

* tokens/s of `spa sft` with its defaults (fp32; `sft.zero_stage: auto`, plain torch for one CPU
  process), and with DeepSpeed ZeRO-2 (`spa_zero2`, the default under a launcher); of TRL as it
  sets itself up (`trl_defaults`: the step's rows in one batch padded to the longest, gradient
  checkpointing on, TRL's default) and tuned like spa (`trl_tuned`: one row a forward, no padding,
  no checkpointing). Tokens counted are real tokens (TRL: `non_padding`);
* the same in bf16 (`*_bf16`, every trainer but ZeRO-2 and TRL's defaults: spa with
  `model.dtype=bfloat16`, fp32 weights under bf16 autocast; TRL with `bf16=True`, the same
  autocast), which is much faster on CPUs with native bf16 matmul (measured when `model.dtype:
  auto` picks bf16 on this CPU, or with --bf16);
* spa with PyTorch's own kernels for the linear layers instead of oneDNN's (`spa_stock_linears`,
  `stages.common.kernels.linear`; the same on a GPU), in fp32;
* spa with its rows' common prefixes computed once (`sft.share_prefix`, the default) and without
  (`spa_unshared`), and the same on SPA's one-row-per-turn data (`spa_turns`, `spa_turns_unshared`,
  `trl_tuned_turns`), with tokens counted as the rows' tokens for every trainer (spa with sharing
  computes fewer: `computed_tokens_fraction`);
* the ratios (targets: spa >= 1.3x TRL on trajectory rows, >= 2x on turn rows), each against TRL in
  the same precision;
* MFU = 6 x parameters x computed tokens/s / the matmul FLOP/s measured here in the run's precision (best
  of a 2048^3 matmul, measured before and after the runs, as other work on the machine moves it);
* the peak RSS of a full fine-tune at 2048 tokens (rows left-truncated to 2048, two optimizer
  steps so the AdamW state exists), ZeRO-2 with gradient checkpointing (target <= 4 GB), measured
  with `resource.getrusage` in a subprocess; and the peak RSS of each throughput run.

    python bench/bench_sft.py [--rows-per-step 2] [--steps 3] [--repeats 1] [--skip-trl] [--skip-rss]
                              [--only spa_turns,spa_turns_unshared,trl_tuned_turns]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m"
# The bundled ChatML template with generation tags, for TRL's assistant_only_loss: same text.
TRL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# ---- data --------------------------------------------------------------------------------------


def make_data(work: Path, rows: int, unit: str = "trajectory") -> Path:
    """Sokoban SFT rows from the project's own stages (random actions, true states filled in), one
    per trajectory or (`unit="turn"`, SPA's layout) one per assistant turn."""
    data = work / f"sft-{unit}.jsonl"
    try:
        from stages import clean, generate
        from stages.common.config import load_config

        config = load_config(None, [], {
            "rollout.backend": "random", "rollout.groups": rows, "rollout.group_size": 1,
            "generate.out": str(work / "traj.jsonl"), "generate.resume": True, "clean.data": str(work / "traj.jsonl"),
            "clean.out": str(data), "clean.val_fraction": 0.0, "clean.unit": unit, "quiet": True})
        generate.run(config)
        clean.run(config)
        if sum(1 for _ in data.open()) >= rows // 2:
            return data
    except Exception as err:  # noqa: BLE001 - another stage's failure must not stop the benchmark
        print(f"note: spa generate/clean failed ({err!r}); using the built-in generator", file=sys.stderr)
    return synthetic_data(data, rows)


def synthetic_data(path: Path, rows: int) -> Path:
    """Rows in SPA's layout: instruction, then per turn a state, a world-model answer, a reward."""
    rng = random.Random(0)
    instruction = ("You are solving the Sokoban puzzle. You are the player and you need to push all boxes "
                   "to targets. You are provided with a symbol grid and the zero-indexed coordinates of the "
                   "player, each box, and each target. " * 4)

    def state() -> str:
        cells = [["#"] * 6] + [["#"] + [rng.choice("__X") for _ in range(4)] + ["#"] for _ in range(4)] + [["#"] * 6]
        r, c = rng.randint(1, 4), rng.randint(1, 4)
        cells[r][c] = "P"
        grid = "\n".join("".join(row) for row in cells)
        return f"{grid}\nPlayer (P) is at ({r},{c}); box (X) is at (2,2); target (O) is at (3,3)."

    lines = []
    for i in range(rows):
        now = state()
        messages = [{"role": "system", "content": "You're a helpful assistant. "},
                    {"role": "user", "content": f"{instruction}\nTurn 1:\nState:\n{now}\nYou have 10 actions left."}]
        for turn in range(rng.randint(3, 5)):
            nxt = state()
            messages.append({"role": "assistant", "train": True, "content":
                             f"<think> <observation>{now}</observation> I will push the box to the target. "
                             f"<prediction>{nxt}</prediction> </think> <answer> Up || Left </answer>"})
            messages.append({"role": "user", "content": f"Reward:\n-0.1\n\nTurn {turn + 2}:\nState:\n{nxt}\n"})
            now = nxt
        lines.append(json.dumps({"id": f"b{i}", "messages": messages[:-1]}) + "\n")
    path.write_text("".join(lines))
    return path


# ---- measurements (each in a child process) ------------------------------------------------------


def matmul_peak(dtype: str = "float32", size: int = 2048, reps: int = 6) -> float:
    """Best matmul rate in `dtype`, FLOP/s, over `reps` timed products."""
    import torch

    a, b = (torch.randn(size, size, dtype=getattr(torch, dtype)) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def child_spa(data: str, work: str, rows_per_step: int, steps: int, stage: int | str, checkpointing: bool,
              max_length: int, bf16: bool = False, share: bool = True, stock_linears: bool = False) -> dict:
    from stages import sft
    from stages.common.config import load_config
    from stages.common.kernels import linear

    linear.enabled = not stock_linears

    out = Path(work) / f"spa-{Path(data).stem}-z{stage}-gc{int(checkpointing)}-{max_length}-bf16{int(bf16)}-s{int(share)}"
    config = load_config(None, [], {
        "model.name": MODEL, "model.dtype": "bfloat16" if bf16 else "float32", "sft.data": data, "sft.out": str(out),
        "sft.global_batch": rows_per_step, "sft.stop_after_steps": steps, "sft.zero_stage": stage,
        "sft.gradient_checkpointing": checkpointing, "sft.max_length": max_length, "sft.val_data": "",
        "sft.share_prefix": share, "quiet": True})
    sft.run(config)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out)  # its checkpoint and optimizer state: gigabytes a run, fifteen runs a benchmark
    timed = rows[1:] or rows
    return rates([(r["tokens"], r["seconds"]) for r in timed]) | {
        "loss_first_step": rows[0]["loss"],
        "computed_tokens_fraction": round(sum(r["computed_tokens"] for r in timed) / sum(r["tokens"] for r in timed), 3)}


def rates(steps: list[tuple[int, float]]) -> dict:
    """Best and mean tokens/s over the timed steps (tokens, seconds). The best step is the figure
    compared: other work on a shared machine can only slow a step down."""
    return {"tokens_per_s": max(n / t for n, t in steps),
            "tokens_per_s_mean": sum(n for n, _ in steps) / sum(t for _, t in steps),
            "timed_steps": len(steps), "timed_tokens": sum(n for n, _ in steps)}


def child_trl(data: str, work: str, rows_per_step: int, steps: int, defaults: bool, bf16: bool = False) -> dict:
    """TRL's SFTTrainer. `defaults`: as TRL sets it up (one padded batch a step, gradient
    checkpointing on); else tuned like spa (one row a forward, no padding, no checkpointing)."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from stages.common.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(MODEL)
    tokenizer.chat_template = TRL_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype="float32", attn_implementation="sdpa")
    dataset = load_dataset("json", data_files=data, split="train").select_columns(["messages"])
    marks: list[tuple[float, int]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.perf_counter(), int(state.num_input_tokens_seen)))

    if defaults:
        options = {"per_device_train_batch_size": rows_per_step, "gradient_accumulation_steps": 1}
    else:
        options = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": rows_per_step,
                   "gradient_checkpointing": False}
    args = SFTConfig(
        output_dir=str(Path(work) / f"trl-{Path(data).stem}-{defaults}-{bf16}"), learning_rate=1e-4, adam_beta1=0.9, adam_beta2=0.95,
        weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=0.1, max_grad_norm=1.0,
        max_steps=steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=bf16,
        max_length=2048, assistant_only_loss=True, seed=1, dataloader_num_workers=0,
        include_num_input_tokens_seen="non_padding", disable_tqdm=True, **options)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[Clock()])
    trainer.train()
    steps = [(n1 - n0, t1 - t0) for (t0, n0), (t1, n1) in itertools.pairwise(marks)]
    return rates(steps) | {"gradient_checkpointing": args.gradient_checkpointing,
                           "per_device_train_batch_size": args.per_device_train_batch_size,
                           "loss_first_step": trainer.state.log_history[0].get("loss")}


def run_child(kind: str, **kwargs) -> dict:
    """Run one measurement in a fresh interpreter; returns its JSON plus its peak RSS."""
    cmd = [sys.executable, __file__, "--child", json.dumps({"kind": kind, **kwargs})]
    started = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["load_average"] = os.getloadavg()[0]
    return result


def child_main(spec: dict) -> None:
    kind = spec.pop("kind")
    result = {"spa": child_spa, "trl": child_trl, "peak": lambda: {"flops": matmul_peak(), "flops_bf16":
              matmul_peak("bfloat16")}}[kind](**spec)
    result["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3)
    print(json.dumps(result))


# ---- main --------------------------------------------------------------------------------------


def long_rows(data: Path, path: Path) -> Path:
    """Two rows longer than 2048 tokens (two episodes joined), for the RSS run at max_length 2048."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    joined = [{"id": f"long{i}", "messages": a["messages"] + b["messages"][1:]}
              for i, (a, b) in enumerate(zip(rows[0::2], rows[1::2]))][:2]
    path.write_text("".join(json.dumps(r) + "\n" for r in joined))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-per-step", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds; the best run counts")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per trainer (the first is untimed)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-rss", action="store_true")
    parser.add_argument("--turn-rows-per-step", type=int, default=4,
                        help="rows per optimizer step on the one-row-per-turn data")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure bf16 (default: when model.dtype auto picks it on this CPU)")
    parser.add_argument("--only", help="comma-separated trainers to run (e.g. spa_turns,trl_tuned_turns; default all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(json.loads(args.child))

    from stages.common.config import ModelConfig
    from stages.common.models import load_model, pick_dtype, resolve_model
    from stages.training.sft_data import read_rows, tokenize_rows

    resolve_model(MODEL)  # convert the bundled model once, outside the timings
    work = Path(tempfile.mkdtemp(prefix="bench-sft-"))
    data = make_data(work, rows=args.rows_per_step * args.steps + 2)
    turn_data = make_data(work, rows=args.rows_per_step * args.steps + 2, unit="turn")
    model, tokenizer = load_model(ModelConfig(name=MODEL, device="cpu"))
    params = sum(p.numel() for p in model.parameters())
    stats = tokenize_rows(read_rows(data), tokenizer, 2048)[1]
    turn_stats = tokenize_rows(read_rows(turn_data), tokenizer, 2048)[1]
    del model
    import torch

    bf16 = args.bf16 if args.bf16 is not None else pick_dtype("auto", "cpu") == torch.bfloat16

    common = {"work": str(work), "steps": args.steps}
    rows = {"data": str(data), "rows_per_step": args.rows_per_step}
    turns = {"data": str(turn_data), "rows_per_step": args.turn_rows_per_step}
    trainers = {
        "spa": ("spa", {"stage": "auto", "checkpointing": False, "max_length": 2048, **rows}),  # the defaults
        "spa_zero2": ("spa", {"stage": 2, "checkpointing": False, "max_length": 2048, **rows}),
        "spa_turns": ("spa", {"stage": "auto", "checkpointing": False, "max_length": 2048, **turns}),
        "spa_unshared": ("spa", {"stage": "auto", "checkpointing": False, "max_length": 2048, "share": False,
                                 **rows}),
        "spa_stock_linears": ("spa", {"stage": "auto", "checkpointing": False, "max_length": 2048,
                                      "stock_linears": True, **rows}),
        "spa_turns_unshared": ("spa", {"stage": "auto", "checkpointing": False, "max_length": 2048, "share": False,
                                       **turns}),
    }
    if not args.skip_trl:
        trainers["trl_defaults"] = ("trl", {"defaults": True, **rows})
        trainers["trl_tuned"] = ("trl", {"defaults": False, **rows})
        trainers["trl_tuned_turns"] = ("trl", {"defaults": False, **turns})
    if bf16:  # the same comparisons in bf16 (TRL as it sets itself up aside)
        trainers |= {f"{name}_bf16": (kind, {**options, "bf16": True}) for name, (kind, options) in trainers.items()
                     if name not in ("spa_zero2", "trl_defaults", "spa_stock_linears")}
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(trainers))
        if unknown:
            parser.error(f"--only: no trainer {', '.join(unknown)} here; the trainers are {', '.join(trainers)}")
        trainers = {name: trainers[name] for name in wanted}
    peaks = [run_child("peak")]
    runs: dict[str, dict] = {}
    for _ in range(args.repeats):  # interleaved, so a busy spell on the machine hits every trainer
        for name, (kind, options) in trainers.items():
            run = run_child(kind, **options, **common)
            if name not in runs or run["tokens_per_s"] > runs[name]["tokens_per_s"]:
                runs[name] = run
    rss = None
    if not args.skip_rss:
        long = long_rows(data, work / "long.jsonl")
        rss = run_child("spa", data=str(long), work=str(work), rows_per_step=1, steps=2, stage=2,
                        checkpointing=True, max_length=2048)
    peaks.append(run_child("peak"))
    shutil.rmtree(work)
    peak = {"float32": max(p["flops"] for p in peaks), "bfloat16": max(p["flops_bf16"] for p in peaks)}

    def mfu(name: str, run: dict) -> float:  # FLOPs of the tokens computed (fewer than the rows hold when shared)
        computed = run["tokens_per_s"] * run.get("computed_tokens_fraction", 1.0)
        return round(6 * params * computed / peak["bfloat16" if name.endswith("bf16") else "float32"], 3)

    result = {
        "model": MODEL, "parameters": params, "device": "cpu", "threads": os.cpu_count(),
        "data": {"rows": stats.kept, "mean_tokens": round(stats.tokens / stats.kept),
                 "trained_fraction": round(stats.trained_tokens / stats.tokens, 3)},
        "turn_data": {"rows": turn_stats.kept, "mean_tokens": round(turn_stats.tokens / turn_stats.kept),
                      "trained_fraction": round(turn_stats.trained_tokens / turn_stats.tokens, 3)},
        "rows_per_step": args.rows_per_step, "turn_rows_per_step": args.turn_rows_per_step,
        "timed_steps": args.steps - 1, "repeats": args.repeats,
        "matmul_peak_gflops": {dtype: round(flops / 1e9, 1) for dtype, flops in peak.items()},
    }
    for name, run in runs.items():
        result[name] = {**run, "mfu": mfu(name, run)}
    for name in runs:
        if name.startswith("trl"):
            ours = name.replace("trl_tuned", "spa").replace("trl_defaults", "spa")  # same rows, same precision
            if ours in runs:
                result[f"ratio_vs_{name}"] = round(runs[ours]["tokens_per_s"] / runs[name]["tokens_per_s"], 3)
    if rss:
        result["full_finetune_2048_peak_rss_gb"] = rss["peak_rss_gb"]
        result["rss_run"] = {"zero_stage": 2, "gradient_checkpointing": True, "max_length": 2048,
                             "tokens_per_s": round(rss["tokens_per_s"], 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
