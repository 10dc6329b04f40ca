"""Run the benchmarks in this folder and collect their JSON results in one file.

Each `bench_*.py` prints one JSON object on stdout. The results go to `bench/results.json`, one
entry per benchmark with the machine and date it ran on; a benchmark that was not run this time
keeps its previous entry, so `--only` refreshes some without losing the others.

    python bench/run_all.py                       # every benchmark
    python bench/run_all.py --only bench_ppo      # just these (repeatable)
    python bench/run_all.py --only bench_sft --args "bench_sft=--only spa_turns,trl_tuned_turns"
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def machine() -> dict:
    import torch

    from stages.common.models import cpu_name, matmul_flags

    return {"platform": platform.platform(), "processor": cpu_name(), "cpus": os.cpu_count(),
            "cpu_flags": matmul_flags(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    parser.add_argument("--only", action="append", help="a benchmark's name, e.g. bench_sft (repeatable)")
    parser.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                        help="arguments for one benchmark; its entry is named with them (repeatable)")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.args if "=" in item)
    if len(extra) != len(args.args):
        print("error: --args takes NAME=ARGS, e.g. bench_sft='--only spa_turns'", file=sys.stderr)
        return 2
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        unknown = set(args.only) - {s.stem for s in scripts}
        if unknown:
            print(f"error: no benchmark named {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        scripts = [s for s in scripts if s.stem in args.only]
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    failed = []
    for script in scripts:
        print(f"running {script.name} ...", file=sys.stderr, flush=True)
        start = time.time()
        argv = shlex.split(extra.get(script.stem, ""))
        key = " ".join([script.stem, *argv])  # a partial run keeps the full run's entry beside it
        proc = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            failed.append(script.name)
            results[key] = {"error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
        else:
            results[key] = {**json.loads(proc.stdout.strip().splitlines()[-1]),
                                    "wall_s": round(time.time() - start, 1), "machine": machine()}
        args.out.write_text(json.dumps(results, indent=2) + "\n")  # keep what finished if a later one hangs
    print(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
