"""`report_to`: real TensorBoard event files and a real offline wandb run, read back and compared
with metrics.jsonl figure by figure; a tracker that is not installed stops the run before it starts."""

import importlib.util
import json
import math
import struct
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from spa_cli.main import app
from stages import ppo, sft
from stages.common import tracking
from stages.common.config import load_config
from stages.common.console import Console

runner = CliRunner()


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def tensorboard_scalars(log_dir: Path) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    """Every scalar (tag -> step -> value) and text summary in the event files, read with
    TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    texts = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]}
    return scalars, texts


def wandb_records(run_file: Path) -> list:
    """The records of a wandb run file (``run-ID.wandb``): a 7-byte header (``:W&B``, magic, version),
    then LevelDB-log chunks in 32 KiB blocks (crc, length, type; a record may span blocks), each record
    a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, position = [], b"", 7
    while position + 7 <= len(data):
        block_left = 32768 - position % 32768
        if block_left < 7:  # the block's tail is padding
            position += block_left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # full/first start; middle/last extend
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(records: list) -> dict[int, dict[str, float]]:
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def tracked_figures(rows: list[dict]) -> dict[int, dict[str, float]]:
    return {row["step"]: tracking.numbers(row) for row in rows}


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracking-data")
    result = runner.invoke(app, ["generate", "--backend", "random", "--groups", "4", "--group-size", "1",
                                 "--out", str(root / "t.jsonl"), "--set", "rollout.max_turns=1", "-q"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["clean", "--data", str(root / "t.jsonl"), "--out", str(root / "sft.jsonl"),
                                 "--set", "clean.val_fraction=0.25", "-q"])
    assert result.exit_code == 0, result.output
    return root / "sft.jsonl"


def test_sft_reports_every_figure_to_tensorboard_and_an_offline_wandb_run(sft_data, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "sft"
    config = load_config(None, [f"model.name={tiny_model_dir}", f"sft.data={sft_data}", f"sft.out={out}",
                                "sft.zero_stage=0", "sft.epochs=2", "sft.global_batch=2", "sft.max_length=4096",
                                "tracking.report_to=[tensorboard, wandb]", "tracking.wandb_project=spa-test"])
    sft.run(config)
    rows = read_metrics(out)
    expected = tracked_figures(rows)
    assert len(rows) == 4 and "val_loss" in expected[2] and "val_loss" not in expected[1]  # at epoch ends only

    scalars, texts = tensorboard_scalars(out / tracking.TENSORBOARD_DIR)
    assert set(scalars) == {key for figures in expected.values() for key in figures}
    for step, figures in expected.items():
        for key, value in figures.items():
            assert scalars[key][step] == pytest.approx(value, rel=1e-6), (key, step)  # float32 in the event file
    assert set(scalars["val_loss"]) == {2, 4}
    shown = yaml.safe_load("\n".join(line[4:] for line in texts["config/text_summary"].splitlines()))
    assert shown["sft"]["out"] == str(out) and shown["tracking"]["report_to"] == ["tensorboard", "wandb"]

    run_dirs = list((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    records = wandb_records(next(run_dirs[0].glob("run-*.wandb")))
    history = wandb_history(records)
    assert sorted(history) == sorted(expected)
    for step, figures in expected.items():
        assert history[step] == pytest.approx(figures, rel=1e-12), step
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name, run.job_type) == ("spa-test", "sft", "sft")
    config_items = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config_items["sft"]["epochs"] == 2 and config_items["tracking"]["wandb_mode"] == "offline"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wandb:")]
    assert lines == [f"wandb: offline run saved in {run_dirs[0]}; upload it with `wandb sync {run_dirs[0]}`"]


def test_ppo_reports_its_steps_and_validations_to_tensorboard(tiny_model_dir, tmp_path):
    out = tmp_path / "ppo"
    config = load_config(None, [
        f"model.name={tiny_model_dir}", f"ppo.out={out}", "quiet=true", "ppo.zero_stage=0",
        "rollout.groups=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "rollout.max_turns=1",
        "ppo.steps=2", "ppo.filter_ratio=1.0", "ppo.mini_batch=2", "ppo.val_every=2", "eval.seeds=1",
        "eval.pass_k=2", "tracking.report_to=[tensorboard]"])
    ppo.run(config)
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [0, 1, 2]
    scalars, _ = tensorboard_scalars(out / tracking.TENSORBOARD_DIR)
    for step, figures in tracked_figures(rows).items():
        for key, value in figures.items():
            assert scalars[key][step] == pytest.approx(value, rel=1e-6, abs=1e-12), (key, step)
    assert set(scalars["val_pass@2"]) == {0, 2} and set(scalars["reward"]) == {1, 2}
    for kind in ppo.WORLD_MODEL_KINDS:  # the rollouts' world-model accuracy, step by step
        assert set(scalars[f"wm_{kind}_turns"]) == {1, 2}
    for row in rows:  # a figure undefined at a step (null) is no point of its curve, not a 0
        for key in (key for key, value in row.items() if value is None):
            assert row["step"] not in scalars.get(key, {}), (key, row["step"])


def test_a_resumed_run_replaces_the_steps_it_logs_again(tmp_path):
    config = load_config(None, ["tracking.report_to=[tensorboard]"])
    with tracking.start(config, tmp_path, "sft", None, Console(quiet=True)) as tracker:
        for step in (1, 2, 3):
            tracker.log({"step": step, "loss": float(step), "note": "text is not a figure", "flag": True,
                         "val_loss": None, "bad": math.nan})
    with tracking.start(config, tmp_path, "sft", 1, Console(quiet=True)) as tracker:  # resumed after step 1
        for step in (2, 3, 4):
            tracker.log({"step": step, "loss": 10.0 * step})
    scalars, texts = tensorboard_scalars(tmp_path / tracking.TENSORBOARD_DIR)
    assert scalars == {"loss": {1: 1.0, 2: 20.0, 3: 30.0, 4: 40.0}}
    assert list(texts) == ["config/text_summary"]


def test_only_the_main_process_opens_trackers(tmp_path):
    config = load_config(None, ["tracking.report_to=[tensorboard]"])
    with tracking.start(config, tmp_path, "ppo", None, Console(quiet=True), main=False) as tracker:
        tracker.log({"step": 1, "reward": 1.0})
    assert not (tmp_path / tracking.TENSORBOARD_DIR).exists()


@pytest.mark.parametrize("command", ["sft", "ppo", "pipeline"])
def test_a_tracker_that_is_not_installed_stops_the_run_before_it_starts(command, monkeypatch, tmp_path,
                                                                       tiny_model_dir, sft_data):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    out = tmp_path / "run"
    args = {"sft": ["sft", "--data", str(sft_data), "--model", str(tiny_model_dir), "--out", str(out)],
            "ppo": ["ppo", "--model", str(tiny_model_dir), "--out", str(out), "--set", "ppo.zero_stage=0"],
            "pipeline": ["pipeline", "--dir", str(out), "--set", "pipeline.data_policy=random"]}[command]
    result = runner.invoke(app, [*args, "--report-to", "tensorboard", "--report-to", "wandb"])
    assert result.exit_code == 2, result.output
    assert result.stderr == "error: report_to names wandb, which is not installed; pip install wandb\n"
    assert not out.exists()


def test_report_to_none_beside_a_tracker_or_an_unknown_tracker_is_refused(tmp_path, sft_data, tiny_model_dir):
    base = ["sft", "--data", str(sft_data), "--model", str(tiny_model_dir), "--out", str(tmp_path / "run")]
    result = runner.invoke(app, [*base, "--report-to", "none", "--report-to", "wandb"])
    assert (result.exit_code, result.stderr) == (
        2, "error: tracking.report_to lists none beside wandb; give either none or trackers\n")
    result = runner.invoke(app, [*base, "--report-to", "mlflow"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: tracking.report_to[0] must be one of none, tensorboard, wandb; got 'mlflow'")
    assert not (tmp_path / "run").exists()
