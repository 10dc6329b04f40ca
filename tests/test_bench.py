"""bench/results.json: one entry per benchmark, each with what it ran on, written by run_all."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import run_all


def test_results_hold_one_entry_per_benchmark_with_where_and_how_it_ran():
    results = json.loads((BENCH / "results.json").read_text())
    assert set(results) == {script.stem for script in BENCH.glob("bench_*.py")}
    for name, entry in results.items():
        assert tuple(entry) == run_all.FIELDS, name
        assert entry["command"].startswith(f"python bench/{name}.py"), name
        assert entry["cores"] >= 1 and entry["dtype"] in ("float32", "bfloat16") and entry["result"], name


@pytest.fixture
def bench_dir(tmp_path):
    (tmp_path / "bench_fast.py").write_text("import json, sys\nprint('warming up')\n"
                                            "print(json.dumps({'args': sys.argv[1:], 'rooms_per_s': 12.5}))\n")
    (tmp_path / "bench_broken.py").write_text("import sys\nsys.exit('error: no such thing')\n")
    return tmp_path


def test_run_all_writes_the_latest_run_of_each_benchmark_and_keeps_what_failed(bench_dir):
    out = bench_dir / "results.json"
    out.write_text(json.dumps({"bench_broken": {"result": "an earlier run"}}))
    assert run_all.main(["--args", "bench_fast=--rooms 3"], bench_dir=bench_dir) == 1  # one failed
    results = json.loads(out.read_text())
    assert results["bench_broken"] == {"result": "an earlier run"}
    entry = results["bench_fast"]
    assert tuple(entry) == run_all.FIELDS
    assert entry["command"] == "python bench/bench_fast.py --rooms 3"
    assert entry["result"] == {"args": ["--rooms", "3"], "rooms_per_s": 12.5}
    assert entry["cores"] >= 1 and entry["dtype"] == "float32"  # the tests pin model.dtype auto to fp32
    assert run_all.main(["--only", "bench_fast"], bench_dir=bench_dir) == 0
    assert json.loads(out.read_text())["bench_fast"]["command"] == "python bench/bench_fast.py"
    assert not list(bench_dir.glob(".*.tmp"))
