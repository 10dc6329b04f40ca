"""Run every benchmark in this folder and write their JSON results into one file.

Each `bench_*.py` prints one JSON object on stdout. The combined result, with the machine it ran
on, goes to `bench/results.json` (or the path given as the first argument) and to stdout.
"""

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "date": time.strftime("%Y-%m-%d")}


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results.json"
    results, failed = {"machine": machine()}, []
    for script in sorted(HERE.glob("bench_*.py")):
        print(f"running {script.name} ...", file=sys.stderr, flush=True)
        start = time.time()
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            failed.append(script.name)
            results[script.stem] = {"error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
            continue
        results[script.stem] = json.loads(proc.stdout.strip().splitlines()[-1])
        results[script.stem]["wall_s"] = round(time.time() - start, 1)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
