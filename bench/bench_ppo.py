"""Seconds per `spa ppo` step, by phase, for SmolLM2-135M on Sokoban (CPU by default): the
default passes beside the cheaper ones, side by side in one run, and the update phase's tokens/s.

A small config (2 groups x 4 episodes, 2 turns of at most 48 new tokens, every group kept, one
mini-batch, GAE with the critic) runs for `--steps` steps per variant; the first step pays
one-off costs (DeepSpeed and allocator warm-up) and is left out of the figures, which are
medians over the rest. Variants (`ppo.*` settings):

* ``unpacked``: every episode its own sequence in the actor, critic and reference passes, old
  log-probs and values from no-grad passes before the update (`ppo.share_prefix: false`,
  `ppo.score_in_update: false`);
* ``packed_scoring_passes``: a micro-batch's episodes in one sequence laid out as a prefix tree, the
  instruction they all share and each group's first prompt computed once (`ppo.share_prefix`), with
  the no-grad scoring passes;
* ``packed``: the defaults: packed, and the old log-probs and values taken from the update's own
  forward passes (`ppo.score_in_update`: one epoch over one mini-batch, as here), so no scoring
  passes; the same algorithm (separate critic, no shared trunk);
* ``packed_zero2``: packed, on DeepSpeed ZeRO-2 (`ppo.zero_stage=2`, what ``auto`` picks under a
  launcher or on CUDA) instead of the engine ``auto`` picks for one CPU process (plain torch):
  what ZeRO's bookkeeping costs a process that has nothing to shard;
* ``packed_sampler_logprobs``: packed, and the old log-probs taken from the sampler
  (`ppo.old_logprobs=sampler`; fp32 only);
* ``packed_lora``: packed, LoRA adapters (rank 16) on actor and critic instead of full
  fine-tuning (`ppo.lora_rank`): no weight gradients or optimizer state for the base weights;
* ``packed_shared_critic``: packed, the value head on the actor's trunk (`ppo.critic=shared`): one
  forward and backward for both losses, no second network;
* ``cheapest``: packed, sampler log-probs, LoRA and the shared critic together (fp32 only);
* ``packed_stock_linears``: packed, with PyTorch's own kernels for the linear layers in the
  rollouts and the update instead of oneDNN's (`stages.common.kernels.linear`; CPU only): what those
  save in each phase;
* ``packed_transformers_forward``: packed, with transformers' own forward for the rollouts' decode
  steps instead of `stages.common.kernels.decode.DecodeStep` (CPU only): what that saves the
  rollout phase;
* ``packed_vllm``: packed, with vLLM's rollouts (``rollout.backend=vllm``, where vLLM is
  installed; fp32): the engine starts with the run and its start-up is in no phase; the update
  phase includes pushing the new weights into it. Its samples are vLLM's, so its step-1 losses
  are not compared.

``--config`` runs the steps with a config file's settings instead of the small ones (the model and
dtype still the benchmark's): e.g. ``configs/repro_cpu/rl_frozen_lake.yaml``, the RL of ``make
repro-cpu``, from the base model rather than an SFT checkpoint (the same shapes, so the same speed).

Each variant runs in a fresh interpreter, one after another, so a crash costs only its own figures.

Every variant plays the same rollouts at step 1 (same seeds, same weights: LoRA adapters start at
zero and a value head at zero, shared or not), so its step-1 losses must equal the first
variant's: their largest difference is reported (`step1_max_rel_diff`), relative to the figure,
or to 1 for pg_loss (a mean of whitened advantages times ratios near 1: its scale is 1, its
value near 0).
``update_tokens_per_s`` counts the kept episodes' tokens once per PPO epoch over the whole update
phase (a forward and backward pass of the actor AND of the critic, plus both optimizer steps; one
pass of one network with a shared critic); with a separate critic it compares with `spa sft`'s
tokens/s (one model) after dividing by two. Prints one JSON object.
"""

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PHASES = ("rollout", "old_logprobs", "values", "update")
LORA = ["ppo.lora_rank=16", "ppo.lora_alpha=32"]
VARIANTS = {
    "unpacked": ["ppo.share_prefix=false", "ppo.score_in_update=false"],
    "packed_scoring_passes": ["ppo.share_prefix=true", "ppo.score_in_update=false"],
    "packed": ["ppo.share_prefix=true"],
    "packed_zero2": ["ppo.share_prefix=true", "ppo.zero_stage=2"],
    "packed_sampler_logprobs": ["ppo.share_prefix=true", "ppo.old_logprobs=sampler"],
    "packed_lora": ["ppo.share_prefix=true", *LORA],
    "packed_shared_critic": ["ppo.share_prefix=true", "ppo.critic=shared"],
    "cheapest": ["ppo.share_prefix=true", "ppo.old_logprobs=sampler", *LORA, "ppo.critic=shared"],
    "packed_stock_linears": ["ppo.share_prefix=true"],
    "packed_transformers_forward": ["ppo.share_prefix=true"],
    "packed_vllm": ["ppo.share_prefix=true", "rollout.backend=vllm"],
}
#: Variants whose rollouts run the linear layers on PyTorch's own kernels (see the docstring).
STOCK_LINEARS = ("packed_stock_linears",)
#: Variants whose rollouts decode with transformers' forward (see the docstring).
TRANSFORMERS_FORWARD = ("packed_transformers_forward",)
#: Variants whose step-1 rollouts are not the hf backend's samples (another sampler): not compared.
OTHER_SAMPLER = ("packed_vllm",)
#: Step-1 figures every variant must reproduce (relative difference). Not ppo_kl: with trainer
#: log-probs the first mini-batch's KL is ~0 by construction, with the sampler's it is their
#: ~3e-6 difference, so its ratio says nothing; it is reported as is (``step1_ppo_kl``).
COMPARED = ("pg_loss", "value_loss", "entropy")
#: Of COMPARED, those compared relative to 1 rather than to themselves (see the module docstring).
DIFFERENCE_FIGURES = ("pg_loss",)


def measure(args: argparse.Namespace, dtype: str, variant: list[str]) -> tuple[dict, dict]:
    """Run `spa ppo` for `args.steps` steps; the medians over all steps but the first, and step 1's row."""
    from stages import ppo
    from stages.common.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ppo"
        run = [f"model.name={args.model}", f"model.dtype={dtype}", f"ppo.out={out}", "quiet=true",
               f"ppo.steps={args.steps}", "ppo.val_every=0", f"ppo.save_every={args.steps + 1}"]
        if not args.config:
            episodes = args.groups * args.group_size
            run += [f"env.name={args.env}", f"rollout.groups={args.groups}", f"rollout.group_size={args.group_size}",
                    f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.max_turns={args.max_turns}",
                    "ppo.filter_ratio=1.0", f"ppo.mini_batch={episodes}"]
        config = load_config(args.config, [*run, *variant])
        episodes = config.rollout.groups * config.rollout.group_size
        start = time.perf_counter()
        ppo.run(config)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = rows[1:] or rows
    figures = {
        "steps_measured": len(measured),
        "seconds_per_step": round(statistics.median(sum(r[f"seconds_{p}"] for p in PHASES) for r in measured), 2),
        **{f"seconds_{p}": round(statistics.median(r[f"seconds_{p}"] for r in measured), 2) for p in PHASES},
        "tokens_per_step": round(statistics.median(r["sequence_length"] * r["kept_episodes"] for r in measured)),
        "sampled_tokens_per_step": round(statistics.median(r["response_length"] * episodes for r in measured)),
        "update_tokens_per_s": round(statistics.median(r["update_tokens_per_s"] for r in measured), 1),
        "logp_diff": max((r["logp_diff"] for r in rows if r.get("logp_diff") is not None), default=None),
        "wall_s_total": round(wall, 1),
    }
    return figures, rows[0]


def run_child(args: argparse.Namespace, name: str, dtype: str) -> dict:
    """`measure` of one variant in a fresh interpreter (the same settings): its figures and step-1
    row, or the error it ended with."""
    argv = [f"--model={args.model}", f"--env={args.env}", f"--steps={args.steps}", f"--groups={args.groups}",
            f"--group-size={args.group_size}", f"--max-new-tokens={args.max_new_tokens}",
            f"--max-turns={args.max_turns}", *([f"--config={args.config}"] if args.config else [])]
    proc = subprocess.run([sys.executable, __file__, *argv, "--child", name, "--child-dtype", dtype],
                          capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--env", default="sokoban")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--config", help="a config file whose settings the steps run with (see the docstring)")
    parser.add_argument("--dtype", action="append", choices=("auto", "float32", "bfloat16"),
                        help="model.dtype to measure (repeatable; default auto: what this CPU runs faster)")
    parser.add_argument("--variant", action="append", choices=tuple(VARIANTS),
                        help="variants to measure (repeatable; default all)")
    parser.add_argument("--child", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--child-dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        from stages.common.kernels import decode, linear

        linear.enabled = args.child not in STOCK_LINEARS
        if args.child in TRANSFORMERS_FORWARD:
            decode.DecodeStep.applies = staticmethod(lambda model: False)
        figures, first_row = measure(args, args.child_dtype, VARIANTS[args.child])
        print(json.dumps({"figures": figures, "first_row": first_row}))
        return

    import torch

    from stages.common.models import pick_dtype

    result = {"model": args.model, "device": "cuda" if torch.cuda.is_available() else "cpu", "steps": args.steps}
    if args.config:
        result["config"] = args.config
    else:
        result |= {"env": args.env, "episodes_per_step": args.groups * args.group_size, "max_turns": args.max_turns,
                   "max_new_tokens": args.max_new_tokens}
    for dtype in args.dtype or ["auto"]:
        resolved = str(pick_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")).removeprefix("torch.")
        runs, first_rows, failed = {}, {}, {}
        for name in args.variant or list(VARIANTS):
            if "ppo.old_logprobs=sampler" in VARIANTS[name] and resolved != "float32":
                continue  # sampler log-probs are for fp32 only
            if name == "packed_vllm" and (importlib.util.find_spec("vllm") is None or resolved != "float32"):
                continue  # vLLM rollouts where vLLM is installed, in fp32 (its CPU build's precision here)
            outcome = run_child(args, name, dtype)  # one variant failing, even crashing, keeps the others' figures
            if "error" in outcome:
                failed[name] = outcome["error"]
            else:
                runs[name], first_rows[name] = outcome["figures"], outcome["first_row"]
        base = next(iter(runs))
        for name, figures in runs.items():
            figures["step1_ppo_kl"] = first_rows[name]["ppo_kl"]
            figures["speedup_vs_" + base] = round(runs[base]["seconds_per_step"] / figures["seconds_per_step"], 2)
            if name in OTHER_SAMPLER:
                continue
            figures["step1_max_rel_diff"] = max(
                abs(first_rows[name][key] - first_rows[base][key])
                / (1.0 if key in DIFFERENCE_FIGURES else max(abs(first_rows[base][key]), 1e-12))
                for key in COMPARED)
        result[resolved] = runs | {name: {"error": message} for name, message in failed.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
