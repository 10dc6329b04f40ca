"""Interrupting the stages for real: SIGINT and SIGKILL sent to `spa generate`, `spa sft`, `spa ppo`
and `spa eval` subprocesses (tiny random model, tiny settings) at a deterministic point, then the
same command again. Nothing is lost or duplicated, no checkpoint is half-written, training goes on
from the last saved state, and the final artifacts equal an uninterrupted run's: the samplers are
seeded per episode (hf with batch_size 1) and the trainers resume exactly.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from spa_cli.main import app

INTERRUPTED = "interrupted; run the same command again to resume"
#: The hf backend one episode at a time: each episode's samples then depend on its own seed only.
ROLLOUT = ("--set", "rollout.batch_size=1", "--set", "rollout.max_new_tokens=12", "--set", "rollout.max_turns=2")


def spa(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spa_cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


def interrupted(args: list[str], cwd: Path, ready: Callable[[], bool], sig: int) -> subprocess.CompletedProcess:
    """Run `spa args` and send `sig` as soon as `ready()` holds (polled every 20 ms)."""
    process = subprocess.Popen([sys.executable, "-m", "spa_cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=_default_sigint)  # noqa: PLW1509 - no threads start children here
    deadline = time.monotonic() + 300
    while not ready():
        assert process.poll() is None, f"finished before the interruption point: {process.communicate()[1]}"
        assert time.monotonic() < deadline, "the interruption point never came"
        time.sleep(0.02)
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _default_sigint() -> None:
    """A job started in the background (nohup, `cmd &` in a script) inherits SIGINT ignored, and
    Python then never raises KeyboardInterrupt: give the child the terminal's default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_stopped_by(result: subprocess.CompletedProcess, sig: int) -> None:
    if sig == signal.SIGKILL:
        assert result.returncode == -signal.SIGKILL, result.stderr
    else:
        assert result.returncode == 130, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().splitlines()[-1] == INTERRUPTED


def completed(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr


def lines(path: Path) -> int:
    """Whole lines only: a row being written has no newline yet."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def rows_by_id(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {row["id"]: row for row in rows}
    assert len(by_id) == len(rows), "an episode is duplicated"
    return by_id


def tear_last_line(path: Path) -> None:
    """What a kill in the middle of a write leaves: half a line at the end."""
    last = path.read_text().splitlines()[-1]
    with path.open("a") as handle:
        handle.write(last[: len(last) // 2])


def no_leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*")]


def assert_checkpoints_load(root: Path) -> None:
    """Every checkpoint directory present is whole: its config and every safetensors file load."""
    for config in root.rglob("config.json"):
        if any(part.startswith(".") for part in config.relative_to(root).parts):
            continue  # temp dirs of an interrupted save are not checkpoints; the next run removes them
        json.loads(config.read_text())
        weights = list(config.parent.glob("*.safetensors"))
        assert weights, f"{config.parent} has no weights"
        for path in weights:
            load_file(path)


def assert_same_weights(a: Path, b: Path) -> None:
    left, right = load_file(a), load_file(b)
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), key


# ---- generate and eval: episodes -----------------------------------------------------------------


@pytest.fixture(scope="module")
def generate_reference(tiny_model_dir, tmp_path_factory):
    """The episodes of an uninterrupted `spa generate` (6 episodes)."""
    cwd = tmp_path_factory.mktemp("generate-reference")
    completed(spa(*generate_args(tiny_model_dir, cwd / "t.jsonl"), cwd=cwd))
    return rows_by_id(cwd / "t.jsonl")


def generate_args(model: Path, out: Path) -> list[str]:
    """--resume from the first run on, so that the rerun is the very same command."""
    return ["generate", "--model", str(model), "--groups", "3", "--group-size", "2", *ROLLOUT, "--out", str(out),
            "--resume"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_generate_interrupted_then_rerun_has_every_episode_once(sig, tiny_model_dir, generate_reference, tmp_path):
    out = tmp_path / "t.jsonl"
    args = generate_args(tiny_model_dir, out)
    assert_stopped_by(interrupted(args, tmp_path, lambda: lines(out) >= 2, sig), sig)
    assert 2 <= lines(out) < len(generate_reference), "the run was not cut in the middle"
    kept = rows_by_id(out)
    assert all(kept[key] == generate_reference[key] for key in kept)
    if sig == signal.SIGKILL:
        tear_last_line(out)
    completed(spa(*args, cwd=tmp_path))
    assert rows_by_id(out) == generate_reference
    assert no_leftovers(tmp_path) == []


@pytest.fixture(scope="module")
def eval_reference(tiny_model_dir, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("eval-reference")
    completed(spa(*eval_args(tiny_model_dir, cwd / "report.json"), cwd=cwd))
    return json.loads((cwd / "report.json").read_text()), rows_by_id(cwd / "report.trajectories.jsonl")


def eval_args(model: Path, out: Path) -> list[str]:
    return ["eval", "--model", str(model), "--seeds", "3", "--pass-k", "2", *ROLLOUT, "--out", str(out), "--resume"]


def same_report(a: dict, b: dict) -> bool:
    """Equal but for when and where they were written."""
    ignore = ("created", "trajectories")
    return {k: v for k, v in a.items() if k not in ignore} == {k: v for k, v in b.items() if k not in ignore}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_eval_interrupted_then_rerun_resumes_its_episodes(sig, tiny_model_dir, eval_reference, tmp_path):
    report, episodes = eval_reference
    out = tmp_path / "report.json"
    played = tmp_path / "report.trajectories.jsonl"
    args = eval_args(tiny_model_dir, out)
    assert_stopped_by(interrupted(args, tmp_path, lambda: lines(played) >= 2, sig), sig)
    assert not out.exists(), "a report was written before the eval finished"
    assert 2 <= lines(played) < len(episodes)
    before = rows_by_id(played)
    if sig == signal.SIGKILL:
        tear_last_line(played)
    completed(spa(*args, cwd=tmp_path))
    resumed = rows_by_id(played)
    assert all(resumed[key] == row for key, row in before.items())  # kept, not played again
    assert resumed == episodes
    assert same_report(json.loads(out.read_text()), report)
    assert no_leftovers(tmp_path) == []


# ---- sft and ppo: checkpoints ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> Path:
    """7 training rows and 1 validation row of RandSFT data."""
    root = tmp_path_factory.mktemp("sft-data")
    runner = CliRunner()
    for args in (["generate", "--backend", "random", "--groups", "4", "--group-size", "2", "--out",
                  str(root / "t.jsonl")],
                 ["clean", "--data", str(root / "t.jsonl"), "--out", str(root / "sft.jsonl")]):
        assert runner.invoke(app, args).exit_code == 0
    return root / "sft.jsonl"


def sft_args(data: Path, model: Path, out: Path, zero_stage: int) -> list[str]:
    """4 optimizer steps of 2 rows, every step saved; --resume from the first run on, so that the
    rerun is the very same command."""
    return ["sft", "--data", str(data), "--model", str(model), "--out", str(out), "--epochs", "1", "--resume",
            "--set", "sft.global_batch=2", "--set", "sft.save_every_steps=1", "--set", f"sft.zero_stage={zero_stage}"]


def saved_step(out: Path) -> int:
    try:
        return json.loads((out / "trainer_state" / "progress.json").read_text())["progress"]["global_step"]
    except (OSError, ValueError, KeyError):
        return 0  # not written yet, or being swapped in


def metric_rows(out: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def is_measurement(key: str) -> bool:
    """A metrics field that measures the machine (time, speed, memory), not the training."""
    return key.startswith("seconds") or key.endswith("per_s") or key == "peak_rss_gb"


def without_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not is_measurement(k)}


@pytest.mark.parametrize("sig, zero_stage", [(signal.SIGINT, 0), (signal.SIGKILL, 2)],
                         ids=["SIGINT-plain-torch", "SIGKILL-deepspeed-zero2"])
def test_sft_interrupted_then_rerun_ends_with_the_uninterrupted_weights(sig, zero_stage, sft_data, tiny_model_dir,
                                                                       tmp_path):
    reference = tmp_path / "reference"
    completed(spa(*sft_args(sft_data, tiny_model_dir, reference, zero_stage), cwd=tmp_path))
    out = tmp_path / "run"
    args = sft_args(sft_data, tiny_model_dir, out, zero_stage)
    assert_stopped_by(interrupted(args, tmp_path, lambda: saved_step(out) >= 2, sig), sig)
    assert not (out / "final").exists(), "the run was not cut in the middle"
    assert_checkpoints_load(out)
    step = saved_step(out)
    rows_before = metric_rows(out)
    completed(spa(*args, cwd=tmp_path))
    rows = metric_rows(out)
    assert sorted(rows) == [1, 2, 3, 4]
    # Steps up to the saved state were not trained again: their rows are the first run's, timing included.
    assert all(rows[s] == rows_before[s] for s in range(1, step + 1))
    reference_rows = metric_rows(reference)
    assert all(without_timing(rows[s]) == without_timing(reference_rows[s]) for s in rows)
    assert_same_weights(out / "final" / "model.safetensors", reference / "final" / "model.safetensors")
    assert_checkpoints_load(out)
    assert no_leftovers(out) == []


@pytest.fixture(scope="module")
def ppo_reference(tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ppo-reference")
    completed(spa(*ppo_args(tiny_model_dir, root / "run"), cwd=root))
    return root / "run"


def ppo_args(model: Path, out: Path) -> list[str]:
    """3 PPO steps of 2x2 one-turn episodes, plain torch, a checkpoint after every step."""
    settings = ["rollout.groups=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "rollout.max_turns=1",
                "ppo.filter_ratio=1.0", "ppo.mini_batch=4", "ppo.save_every=1", "ppo.val_every=0",
                "ppo.actor_lr=1e-3", "ppo.critic_lr=1e-3", "ppo.zero_stage=0"]
    sets = [item for setting in settings for item in ("--set", setting)]
    return ["ppo", "--model", str(model), "--out", str(out), "--steps", "3", "--resume", *sets]


def saved_ppo_step(out: Path) -> int:
    try:
        return json.loads((out / "trainer_state" / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0  # not written yet, or being swapped in


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_ppo_interrupted_then_rerun_ends_with_the_uninterrupted_weights(sig, tiny_model_dir, ppo_reference,
                                                                       tmp_path):
    out = tmp_path / "run"
    args = ppo_args(tiny_model_dir, out)
    assert_stopped_by(interrupted(args, tmp_path, lambda: saved_ppo_step(out) >= 1, sig), sig)
    assert not (out / "final").exists(), "the run was not cut in the middle"
    assert_checkpoints_load(out)
    saved = saved_ppo_step(out)
    rows_before = metric_rows(out)
    completed(spa(*args, cwd=tmp_path))
    rows, reference_rows = metric_rows(out), metric_rows(ppo_reference)
    assert sorted(rows) == [1, 2, 3]
    # Steps up to the saved checkpoint were not run again: their rows are the first run's, timing included.
    assert all(rows[s] == rows_before[s] for s in range(1, saved + 1))
    timing = [key for key in reference_rows[1] if is_measurement(key)]
    for step in rows:
        assert {k: v for k, v in rows[step].items() if k not in timing} == {
            k: v for k, v in reference_rows[step].items() if k not in timing}, step
    assert_same_weights(out / "final" / "model.safetensors", ppo_reference / "final" / "model.safetensors")
    assert_checkpoints_load(out)
    assert no_leftovers(out) == []


def test_an_interrupt_without_resume_says_to_add_it(monkeypatch):
    """A stage continues a run only with --resume, so the interrupt line says so."""
    from stages import sft

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sft, "run", stopped)
    result = CliRunner().invoke(app, ["sft", "--data", "sft.jsonl"])
    assert result.exit_code == 130
    assert result.stderr.strip() == "interrupted; run the same command again with --resume to resume"
