"""`spa ppo` over 1 and 2 CPU ranks (torchrun, gloo): seconds per step by phase, and what the ranks
send each other per step (bytes and seconds of every collective), for SmolLM2-135M on Sokoban.

Each world size runs the same small config (`--groups` groups x `--group-size` episodes of one
turn of at most `--max-new-tokens` tokens, every group kept, one mini-batch, DeepSpeed ZeRO-2,
fp32) for `--steps` steps; the figures are medians over the steps after the first, which pays the
one-off costs (collectives: over the steps after the first but the last, which also saves the
final checkpoint). Per step:

* ``seconds_*``: rank 0's phases from metrics.jsonl (``exchange`` is spa's own gathers of the
  episodes and scores, which includes waiting for the slowest rank's rollouts);
* ``collectives``: per collective (all_reduce, reduce_scatter_tensor, all_gather_into_tensor, ...,
  all_gather_object), the calls, the payload bytes (the tensor handed to the call: under ZeRO-2 a
  backward pass reduce-scatters every gradient, an optimizer step all-gathers every updated
  weight, so the payload grows with the model, not with the batch) and the seconds rank 0 spent
  in them, waiting included.

torchrun gives each of several ranks one thread (OMP_NUM_THREADS=1) and a lone rank every core, so
both world sizes use the whole machine. On a 2-core machine two ranks share the cores that one
rank uses, so expect no speed-up; the
point is the per-step communication volume and time, from which a reader can extrapolate to GPUs
and interconnects. Prints one JSON object.

    python bench/bench_ppo_dist.py                       # worlds 1 and 2
    python bench/bench_ppo_dist.py --worlds 2 --steps 3
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PHASES = ("rollout", "exchange", "old_logprobs", "values", "update")
#: torch.distributed calls whose traffic is counted: DeepSpeed's collectives and spa's gathers.
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
               "broadcast", "reduce", "all_gather_object", "broadcast_object_list", "barrier")


# ---- the worker: one rank of `spa ppo` with its collectives counted -----------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch

    from stages import ppo
    from stages.common.config import load_config

    counts: dict[str, dict[str, float]] = {name: {"calls": 0, "bytes": 0, "seconds": 0.0} for name in COLLECTIVES}
    snapshots: list[dict] = []
    count_collectives(torch.distributed, counts)
    real_play_share = ppo.play_share

    def play_share(*a, **k):  # a step starts: snapshot the counters
        snapshots.append(json.loads(json.dumps(counts)))
        return real_play_share(*a, **k)

    ppo.play_share = play_share
    episodes = args.groups * args.group_size
    config = load_config(None, [
        f"model.name={args.model}", f"env.name={args.env}", f"ppo.out={args.out}", "quiet=true",
        f"rollout.groups={args.groups}", f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.max_turns=1",
        f"rollout.batch_size={args.group_size}", f"ppo.steps={args.steps}", "ppo.filter_ratio=1.0",
        f"ppo.mini_batch={episodes}", "ppo.val_every=0", f"ppo.save_every={args.steps + 1}",
        f"ppo.micro_batch_tokens={args.micro_batch_tokens}",
    ])
    ppo.run(config)
    if int(os.environ.get("RANK", "0")) == 0:  # from one step's start to the next (the last step also saves final/)
        steps = [{name: {key: after[name][key] - before[name][key] for key in after[name]} for name in after}
                 for before, after in itertools.pairwise(snapshots)]
        (Path(args.out) / "collectives.json").write_text(json.dumps(steps))


def count_collectives(module, counts: dict) -> None:
    """Wrap `module`'s collectives (before DeepSpeed binds them) to add up calls, payload bytes and
    seconds; an asynchronous call is waited for inside the timer."""
    for name in COLLECTIVES:
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            start = time.perf_counter()
            result = _real(*args, **kwargs)
            if hasattr(result, "wait"):
                result.wait()
            counts[_name]["seconds"] += time.perf_counter() - start
            counts[_name]["calls"] += 1
            counts[_name]["bytes"] += payload_bytes(_name, args, kwargs)
            return result

        setattr(module, name, counted)


def payload_bytes(name: str, args: tuple, kwargs: dict) -> int:
    """The size of the tensor handed to a collective (the larger one of a gather or scatter)."""
    import torch

    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            tensors += [v for v in value if isinstance(v, torch.Tensor)]
    return max((t.numel() * t.element_size() for t in tensors), default=0)


# ---- the driver: one torchrun per world size ------------------------------------------------------------


def measure(args: argparse.Namespace, world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ppo"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(free_port()), str(Path(__file__).resolve()), "--worker", "--out", str(out),
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("model", "env", "steps", "groups", "group_size", "max_new_tokens", "micro_batch_tokens"))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"world {world} failed:\n{proc.stderr[-4000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = json.loads((out / "collectives.json").read_text())
    measured_rows, measured_steps = rows[1:] or rows, steps[1:] or steps
    per_step = {
        name: {key: statistics.median(step[name][key] for step in measured_steps) for key in ("calls", "bytes", "seconds")}
        for name in COLLECTIVES
    }
    per_step = {name: figures for name, figures in per_step.items() if figures["calls"]}
    return {
        "ranks": world,
        "steps_measured": len(measured_rows),
        "seconds_per_step": round(statistics.median(sum(r.get(f"seconds_{p}", 0.0) for p in PHASES)
                                                    for r in measured_rows), 2),
        "steps_per_s": round(1 / statistics.median(sum(r.get(f"seconds_{p}", 0.0) for p in PHASES)
                                                   for r in measured_rows), 4),
        **{f"seconds_{p}": round(statistics.median(r.get(f"seconds_{p}", 0.0) for r in measured_rows), 2)
           for p in PHASES},
        "update_tokens_per_s": round(statistics.median(r["update_tokens_per_s"] for r in measured_rows), 1),
        "collective_bytes_per_step": int(sum(f["bytes"] for f in per_step.values())),
        "collective_seconds_per_step": round(sum(f["seconds"] for f in per_step.values()), 3),
        "collectives": {name: {"calls": int(f["calls"]), "bytes": int(f["bytes"]), "seconds": round(f["seconds"], 3)}
                        for name, f in per_step.items()},
        "wall_s_total": round(wall, 1),
    }


def free_port() -> int:
    from stages.common.distributed import free_port as port

    return port()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--env", default="sokoban")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2, help="a multiple of every world size measured")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096,
                        help="ppo.micro_batch_tokens: fewer tokens, more backward passes a step")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    result = {"model": args.model, "env": args.env, "device": "cpu", "cpus": os.cpu_count(), "steps": args.steps,
              "episodes_per_step": args.groups * args.group_size, "max_new_tokens": args.max_new_tokens,
              "micro_batch_tokens": args.micro_batch_tokens}
    for world in args.worlds:
        result[f"ranks_{world}"] = measure(args, world)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
