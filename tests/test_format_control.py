"""The format control (`sft.state_text: placeholder`, the built-in arm `spa_format_control`) as
configs/repro_cpu/sokoban_format_control.yaml plans it: the Sokoban reproduction's stages, reused,
plus one SFT on the same rows with the placeholder trained, and its eval."""

from pathlib import Path

from stages import pipeline
from stages.common.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "repro_cpu"


def test_the_control_reuses_every_stage_of_the_sokoban_reproduction_and_adds_one_sft_and_its_eval(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the configs' run directories and data paths are relative
    reproduction = pipeline.plan(load_config(CONFIGS / "sokoban.yaml"))
    control = pipeline.plan(load_config(CONFIGS / "sokoban_format_control.yaml"))
    assert control.dir == reproduction.dir
    assert {stage.name: stage.key for stage in reproduction.stages}.items() <= {
        stage.name: stage.key for stage in control.stages}.items()
    added = [stage for stage in control.stages if stage.name not in {s.name for s in reproduction.stages}]
    assert [stage.name for stage in added] == ["sft/spa_format_control", "eval/placeholder_sft"]
    found = {stage.name: stage for stage in control.stages}
    assert added[0].upstream is found["clean/selfplay"] and found["sft/spa"].upstream is found["clean/selfplay"]
    control_sft, spa_sft = vars(added[0].config.sft), vars(found["sft/spa"].config.sft)
    assert (spa_sft["state_text"], control_sft["state_text"]) == ("trained", "placeholder")
    assert {k: v for k, v in control_sft.items() if k not in ("out", "state_text")} == {
        k: v for k, v in spa_sft.items() if k not in ("out", "state_text")}
    assert added[1].upstream is added[0] and added[1].config.eval.prompt_mode == "base"
