"""Seconds per `spa ppo` step, by phase, for SmolLM2-135M on Sokoban (CPU by default), and the
update phase's tokens/s.

A small config (2 groups x 4 episodes, 2 turns of at most 48 new tokens, every group kept, one
mini-batch, GAE with the critic) runs for `--steps` steps; the first step pays one-off costs
(DeepSpeed and allocator warm-up) and is left out of the figures, which are medians over the rest.

``update_tokens_per_s`` counts the kept episodes' tokens once per PPO epoch, over the whole update
phase: a forward and backward pass of the actor AND of the critic, plus both optimizer steps. It
compares with `spa sft`'s tokens/s (one forward and backward of one model) after dividing by two.
Both precisions are measured by default: float32, and bfloat16 (fp32 weights under bf16
autocast, rollouts included), with the hf backend's rollouts; where vLLM is installed, also
float32 with vLLM's (``rollout.backend=vllm``: the engine starts with the run and its start-up is
not in any phase; the update phase includes pushing the new weights into it). ``--runs`` picks
others. Runs share one process, vLLM's last (it changes process-wide state). Prints one JSON object.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PHASES = ("rollout", "old_logprobs", "values", "update")


def measure(args: argparse.Namespace, dtype: str, backend: str) -> dict:
    """Run `spa ppo` for `args.steps` steps in `dtype` with `backend`'s rollouts; the medians over
    all steps but the first."""
    from stages import ppo
    from stages.common.config import load_config

    episodes = args.groups * args.group_size
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ppo"
        config = load_config(None, [
            f"model.name={args.model}", f"model.dtype={dtype}", f"env.name={args.env}", f"ppo.out={out}",
            "quiet=true", f"rollout.groups={args.groups}", f"rollout.group_size={args.group_size}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.max_turns={args.max_turns}",
            f"ppo.steps={args.steps}", "ppo.filter_ratio=1.0", f"ppo.mini_batch={episodes}",
            "ppo.val_every=0", f"ppo.save_every={args.steps + 1}", f"rollout.backend={backend}",
        ])
        start = time.perf_counter()
        ppo.run(config)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = rows[1:] or rows
    return {
        "steps_measured": len(measured),
        "seconds_per_step": round(statistics.median(sum(r[f"seconds_{p}"] for p in PHASES) for r in measured), 2),
        **{f"seconds_{p}": round(statistics.median(r[f"seconds_{p}"] for r in measured), 2) for p in PHASES},
        "tokens_per_step": round(statistics.median(r["sequence_length"] * r["kept_episodes"] for r in measured)),
        "sampled_tokens_per_step": round(statistics.median(r["response_length"] * episodes for r in measured)),
        "update_tokens_per_s": round(statistics.median(r["update_tokens_per_s"] for r in measured), 1),
        "logp_diff": max(r["logp_diff"] for r in rows),
        "wall_s_total": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--env", default="sokoban")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--runs", default=None,
                        help="comma-separated backend:dtype pairs (default hf:float32,hf:bfloat16, and vllm:float32 "
                             "where vLLM is installed; bfloat16 trains fp32 weights under bf16 autocast)")
    args = parser.parse_args()
    import importlib.util

    default = "hf:float32,hf:bfloat16" + (",vllm:float32" if importlib.util.find_spec("vllm") else "")
    runs = [run.split(":") for run in (args.runs or default).split(",")]
    runs.sort(key=lambda run: run[0] == "vllm")  # vLLM last: it changes process-wide state

    import torch

    result = {
        "model": args.model, "env": args.env, "device": "cuda" if torch.cuda.is_available() else "cpu",
        "steps": args.steps, "episodes_per_step": args.groups * args.group_size, "max_turns": args.max_turns,
        "max_new_tokens": args.max_new_tokens,
    }
    for backend, dtype in runs:
        result[dtype if backend == "hf" else f"{dtype}_{backend}"] = measure(args, dtype, backend)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
