"""bench/wm_curve.py's cost accounting: a point that starts from an earlier SFT run has cost that
run's tokens too, so the curve places a self-play round at both rounds' tokens."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_wm_curve():
    spec = importlib.util.spec_from_file_location("wm_curve", ROOT / "bench" / "wm_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_earlier_runs_computed_tokens_are_summed_and_a_hub_model_costs_none(tmp_path):
    wm_curve = load_wm_curve()
    metrics = tmp_path / "sft" / "metrics.jsonl"
    metrics.parent.mkdir()
    rows = [{"step": 1, "tokens": 900, "computed_tokens": 500}, {"step": 2, "tokens": 700}]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # computed tokens where recorded (merged turn rows compute fewer than they train), else tokens
    assert wm_curve.sft_computed_tokens((tmp_path / "sft" / "final").parent / "metrics.jsonl") == 1200
    assert wm_curve.sft_computed_tokens(Path("smollm2-135m").parent / "metrics.jsonl") == 0
