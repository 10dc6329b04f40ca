"""experiments/format_control: its data transform (SPA's SFT rows with "[MASKED]" for every state,
trained like any other text) and its plan (the Sokoban reproduction's stages, reused, plus the
control arms' SFT, PPO and evals)."""

import importlib.util
import json
from pathlib import Path

import pytest

from stages import pipeline
from stages.common.config import load_config
from stages.common.errors import UserError
from stages.common.models import load_tokenizer
from stages.training.sft_data import tokenize_row

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENT = ROOT / "experiments" / "format_control"


def load_format_control():
    spec = importlib.util.spec_from_file_location("format_control", EXPERIMENT / "format_control.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def answer(observation: str, prediction: str) -> str:
    return (f"<think> <observation>{observation}</observation> I push right. <prediction>{prediction}"
            "</prediction> </think> <answer> Right </answer>")


ROW = {"id": "r0", "source_id": "s0", "env": "sokoban", "messages": [
    {"role": "system", "content": "You're a helpful assistant. "},
    {"role": "user", "content": "State:\n#P_X#\nPlayer (P) is at (0,1)."},
    {"role": "assistant", "content": answer("#P_X#\nPlayer (P) is at (0,1).", "#_PX#\nPlayer (P) is at (0,2).")},
    {"role": "user", "content": "Reward:\n-0.1\nState:\n#_PX#\nPlayer (P) is at (0,2)."},
    {"role": "assistant", "content": answer("#_PX#\nPlayer (P) is at (0,2).", "#__PX\nPlayer (P) is at (0,3).")},
]}


def test_placeholder_rows_replace_every_state_of_the_assistant_turns_and_nothing_else():
    [row] = load_format_control().placeholder_rows([ROW])
    assert [m["content"] for m in row["messages"] if m["role"] == "assistant"] == [answer("[MASKED]", "[MASKED]")] * 2
    assert [m for m in row["messages"] if m["role"] != "assistant"] == [m for m in ROW["messages"]
                                                                         if m["role"] != "assistant"]
    assert {k: v for k, v in row.items() if k != "messages"} == {k: v for k, v in ROW.items() if k != "messages"}
    assert ROW["messages"][2]["content"].startswith("<think> <observation>#P_X#")  # the input is not changed


def test_trained_sft_on_placeholder_rows_reads_the_masked_text_and_trains_the_placeholder():
    """The same tokens as the paper's masked ablation (`sft.state_text: masked`), with the
    "[MASKED]" tokens trained instead of left without loss."""
    tokenizer = load_tokenizer("smollm2-135m")
    [row] = load_format_control().placeholder_rows([ROW])
    control = tokenize_row(tokenizer, row["messages"], max_length=4096)
    masked = tokenize_row(tokenizer, ROW["messages"], max_length=4096, state_text="masked")
    assert control.input_ids == masked.input_ids
    trained = [token for token, weight in zip(control.input_ids, control.mask) if weight]
    assert tokenizer.decode(trained) == (answer("[MASKED]", "[MASKED]") + "<|im_end|>") * 2
    assert control.trained > masked.trained


def test_the_data_and_its_validation_split_are_written_from_the_reproductions(tmp_path):
    module = load_format_control()
    source = tmp_path / "selfplay.jsonl"
    source.write_text(json.dumps(ROW) + "\n")
    (tmp_path / "selfplay.val.jsonl").write_text("")
    module.write_placeholder_data(source, tmp_path / "out" / "placeholder.jsonl")
    [row] = [json.loads(line) for line in (tmp_path / "out" / "placeholder.jsonl").read_text().splitlines()]
    assert row == module.placeholder_rows([ROW])[0]
    assert (tmp_path / "out" / "placeholder.val.jsonl").read_text() == ""


def test_the_control_reuses_every_stage_of_the_sokoban_reproduction(tmp_path, monkeypatch):
    """In the reproduction's directory every stage of configs/repro_cpu/sokoban.yaml is one of the
    experiment's with the same settings (so it is skipped there); the experiment adds the RL arms,
    and the control arms one SFT on the masked rows, its eval, and one RL run with its eval."""
    monkeypatch.chdir(tmp_path)  # the configs' run directories and data paths are relative
    config = load_config(EXPERIMENT / "sokoban.yaml")
    reproduction_config, sources = load_format_control().split(config)
    placeholder = Path("runs/repro_cpu/sokoban/sft_data/placeholder.jsonl")
    assert sources == {placeholder: "clean/selfplay"}
    reproduction = pipeline.plan(load_config(ROOT / "configs" / "repro_cpu" / "sokoban.yaml"))
    first_run = pipeline.plan(reproduction_config)  # the reproduction's arms and its RL arms
    assert {stage.name: stage.key for stage in reproduction.stages}.items() <= {
        stage.name: stage.key for stage in first_run.stages}.items()
    with pytest.raises(UserError, match="sft_data .*placeholder.jsonl does not exist"):
        pipeline.plan(config)  # the script writes it first
    placeholder.parent.mkdir(parents=True)
    placeholder.write_text(json.dumps(ROW) + "\n")
    control = pipeline.plan(config)
    assert control.dir == reproduction.dir
    found = {stage.name: stage for stage in control.stages}
    assert all(found[stage.name].key == stage.key for stage in first_run.stages)
    added = [stage for stage in control.stages if stage.name not in {s.name for s in first_run.stages}]
    assert [stage.name for stage in added] == ["sft/placeholder_sft", "eval/placeholder_sft", "ppo/placeholder_rl",
                                               "eval/placeholder_rl"]
    control_sft, spa_sft = vars(added[0].config.sft), vars(found["sft/spa"].config.sft)
    assert (control_sft["data"], added[0].upstream) == (str(placeholder), None)
    paths = ("data", "val_data", "out")
    assert {k: v for k, v in control_sft.items() if k not in paths} == {k: v for k, v in spa_sft.items()
                                                                         if k not in paths}
    assert spa_sft["state_text"] == "trained"


def test_the_script_runs_the_reproduction_then_writes_the_rows_then_runs_every_arm(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = load_format_control()
    ran = []

    def run(config):  # stands for `spa pipeline`: the first run writes the self-play SFT rows
        ran.append([arm if isinstance(arm, str) else arm["name"] for arm in config.pipeline.arms])
        rows = Path("runs/repro_cpu/sokoban/sft_data/selfplay.jsonl")
        if not rows.exists():
            rows.parent.mkdir(parents=True)
            rows.write_text(json.dumps(ROW) + "\n")
        return {}

    monkeypatch.setattr(module.pipeline, "run", run)
    monkeypatch.setattr("sys.argv", ["format_control.py"])
    module.main()
    assert [arms[-2:] for arms in ran] == [["spa_validated", "spa_masked"], ["placeholder_sft", "placeholder_rl"]]
    written = Path("runs/repro_cpu/sokoban/sft_data/placeholder.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in written] == module.placeholder_rows([ROW])
