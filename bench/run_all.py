"""Run the benchmarks in this folder and record the latest result of each in `bench/results.json`.

Each `bench_*.py` prints one JSON object on stdout (its last line). `results.json` holds one entry
per benchmark, named by its script, for its latest successful run, with these fields (`FIELDS`):

* ``date``, ``commit`` (the checkout's, with ``-dirty`` when tracked files differ from it) and
  ``command`` (what to run from the repository's root to measure it again);
* the machine: ``cpu`` (model name), ``cores``, ``cpu_flags`` (the vector extensions that decide
  matmul speed), ``gpu`` (null on a CPU), ``dtype`` (what ``model.dtype: auto`` picks here; a
  benchmark's own ``--dtype`` is in its command) and ``torch``;
* ``wall_s``, the benchmark's wall time, and ``result``, its JSON.

A benchmark that fails keeps its previous entry (the run exits 1); one not run this time keeps its
entry, so `--only` refreshes some without losing the others.

    python bench/run_all.py                       # every benchmark
    python bench/run_all.py --only bench_ppo      # just these (repeatable)
    python bench/run_all.py --only bench_sft --args "bench_sft=--only spa_turns,trl_tuned_turns"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

#: The fields of every entry of results.json.
FIELDS = ("date", "commit", "command", "cpu", "cores", "cpu_flags", "gpu", "dtype", "torch", "wall_s", "result")


def machine() -> dict:
    """Where a benchmark runs: the CPU, its cores and vector extensions, the GPU, the dtype that
    ``model.dtype: auto`` picks here, and torch's version."""
    import torch

    from stages.common.models import cpu_name, matmul_flags, pick_device, pick_dtype

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "cpu_flags": matmul_flags(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "dtype": str(pick_dtype("auto", pick_device())).removeprefix("torch."), "torch": torch.__version__}


def commit() -> str:
    """The checkout's short commit, ``-dirty`` when tracked files (results.json aside) differ."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results.json")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head}-dirty" if changed else head


def run(script: Path, argv: list[str]) -> dict:
    """Run one benchmark; its entry, or ``{"error": last line of stderr}`` if it failed."""
    entry = {"date": time.strftime("%Y-%m-%d"), "commit": commit(),  # the code as the run starts
             "command": shlex.join(["python", f"bench/{script.name}", *argv]), **machine()}
    started = time.time()
    proc = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return {**entry, "wall_s": round(time.time() - started, 1), "result": json.loads(proc.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None, bench_dir: Path = HERE) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=bench_dir / "results.json")
    parser.add_argument("--only", action="append", help="a benchmark's name, e.g. bench_sft (repeatable)")
    parser.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                        help="arguments for one benchmark (repeatable)")
    args = parser.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.args if "=" in item)
    if len(extra) != len(args.args):
        print("error: --args takes NAME=ARGS, e.g. bench_sft='--only spa_turns'", file=sys.stderr)
        return 2
    scripts = sorted(bench_dir.glob("bench_*.py"))
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
        entry = run(script, shlex.split(extra.get(script.stem, "")))
        if "error" in entry:
            failed.append(script.stem)
            print(f"{script.name} failed: {entry['error']}", file=sys.stderr)
            continue
        results[script.stem] = entry
        tmp = args.out.with_name(f".{args.out.name}.tmp")  # whole or not at all; kept if a later one hangs
        tmp.write_text(json.dumps(dict(sorted(results.items())), indent=2) + "\n")
        os.replace(tmp, args.out)
    print(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
