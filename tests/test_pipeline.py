"""`spa pipeline` end to end on a tiny random model: every artifact, the Table-2-like summary,
skipping completed stages, rerunning what a changed setting touches, and continuing after a crash."""

import json

import pytest

from stages import pipeline
from stages.common.config import load_config

STAGES = ["generate", "clean", "sft", "ppo", "ppo_vanilla", "eval_base", "eval_vanilla_ppo", "eval_sft",
          "eval_spa"]


def tiny_pipeline(model_dir, run_dir, *extra):
    return load_config(None, [
        f"model.name={model_dir}", f"pipeline.dir={run_dir}", "quiet=true",
        "pipeline.data_policy=random", "pipeline.data_groups=3", "pipeline.vanilla_ppo=true",
        "rollout.groups=2", "rollout.group_size=2", "rollout.max_turns=1", "rollout.max_new_tokens=8",
        "clean.val_fraction=0.0",
        "sft.epochs=1", "sft.global_batch=2", "sft.zero_stage=0",
        "ppo.steps=1", "ppo.filter_ratio=1.0", "ppo.mini_batch=2", "ppo.zero_stage=0", "ppo.val_every=0",
        "eval.seeds=2", "eval.pass_k=2",
        *extra,
    ])


@pytest.fixture(scope="module")
def finished(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pipeline")
    result = pipeline.run(tiny_pipeline(tiny_model_dir, run_dir))
    return run_dir, result


def test_every_stage_writes_its_artifacts(finished):
    run_dir, result = finished
    assert result["skipped"] == []
    lines = (run_dir / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 6  # data_groups x group_size, played by the random policy
    assert {json.loads(line)["model"] for line in lines} == {"random"}
    assert (run_dir / "sft.jsonl").read_text().count("\n") == 6
    for model in ("sft", "ppo", "ppo_vanilla"):
        assert (run_dir / model / "final" / "model.safetensors").is_file()
    reports = {name: json.loads((run_dir / "eval" / f"{name}.json").read_text())
               for name in ("base", "vanilla_ppo", "sft", "spa")}
    assert reports["spa"]["settings"]["model"] == str(run_dir / "ppo" / "final")
    assert reports["vanilla_ppo"]["settings"]["model"] == str(run_dir / "ppo_vanilla" / "final")
    assert {r["metrics"]["episodes"] for r in reports.values()} == {4}  # 2 seeds x 2 samples each
    state = json.loads((run_dir / pipeline.STATE_FILE).read_text())
    assert list(state) == STAGES and all(entry["complete"] for entry in state.values())


def test_the_table_has_one_row_per_model_in_the_papers_order(finished):
    run_dir, result = finished
    table = (run_dir / "table.md").read_text()
    assert table == result["table"]
    rows = table.splitlines()
    assert rows[0].startswith("| sokoban | Pass@1 | Pass@2 |")
    assert [row.split("|")[1].strip() for row in rows[2:]] == [
        "base model", "+ vanilla PPO", "+ SPA world-model SFT", "+ SPA (SFT, then PPO)"]
    pass1 = json.loads((run_dir / "eval" / "base.json").read_text())["metrics"]["pass@1"]
    assert rows[2].split("|")[2].strip() == f"{100 * pass1:.1f}"


def test_the_run_directory_gets_its_training_curves_and_pass_at_k_plots(finished):
    from helpers import png_size

    run_dir, _ = finished
    # sft (no validation split): loss, lr; ppo (no validation): reward, success, KL, entropy, clip
    # fraction, response length -> 8 panels in rows of 3
    assert png_size(run_dir / "curves.png") == (1440, 3 * 340)
    assert png_size(run_dir / "pass_at_k.png") == (600, 400)


def test_spa_view_of_the_run_directory_holds_its_table_plots_and_eval_episodes(finished, tmp_path):
    from stages.evaluation import viewer

    run_dir, _ = finished
    out = tmp_path / "view.html"
    summary = viewer.write_page(run_dir, out)
    assert summary == f"{out}: 16 episodes (base, sft, spa, vanilla_ppo), plots; open it in a browser"
    page = out.read_text()
    assert page.count('src="data:image/png;base64,') == 2  # curves and Pass@k
    assert "<td>+ SPA (SFT, then PPO)</td>" in page
    data = json.loads(page.split('id="spa-data">')[1].split("</script>")[0])  # JSON reads \u003c as <
    arms = {}
    for episode in data["episodes"]:
        arms[episode["arm"]] = arms.get(episode["arm"], 0) + 1
    assert arms == {"base": 4, "vanilla_ppo": 4, "sft": 4, "spa": 4}


def test_a_second_run_skips_every_completed_stage(finished, tiny_model_dir, capsys):
    run_dir, _ = finished
    before = (run_dir / "sft" / "final" / "model.safetensors").stat().st_mtime_ns
    result = pipeline.run(tiny_pipeline(tiny_model_dir, run_dir))
    assert result["skipped"] == STAGES
    shown = capsys.readouterr().out  # shown even with quiet=true, which only hides progress bars
    assert "[pipeline] generate: complete, skipped" in shown and result["table"].splitlines()[2] in shown
    assert (run_dir / "sft" / "final" / "model.safetensors").stat().st_mtime_ns == before


def test_a_changed_setting_reruns_only_the_stages_that_read_it(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    pipeline.run(tiny_pipeline(tiny_model_dir, run_dir, "pipeline.vanilla_ppo=false"))
    result = pipeline.run(tiny_pipeline(tiny_model_dir, run_dir, "pipeline.vanilla_ppo=false", "sft.lr=2e-4"))
    # sft changed, so did its checkpoint: PPO from it and the evals of both rerun; the data does not
    assert result["skipped"] == ["generate", "clean", "eval_base"]


def test_a_crash_continues_where_it_stopped(tiny_model_dir, tmp_path, monkeypatch):
    from stages import ppo

    run_dir = tmp_path / "run"
    real_run = ppo.run

    def crash(config):
        raise RuntimeError("power cut")

    monkeypatch.setattr(ppo, "run", crash)
    with pytest.raises(RuntimeError, match="power cut"):
        pipeline.run(tiny_pipeline(tiny_model_dir, run_dir, "pipeline.vanilla_ppo=false"))
    state = json.loads((run_dir / pipeline.STATE_FILE).read_text())
    assert state["ppo"]["complete"] is False and state["sft"]["complete"] is True
    monkeypatch.setattr(ppo, "run", real_run)
    result = pipeline.run(tiny_pipeline(tiny_model_dir, run_dir, "pipeline.vanilla_ppo=false"))
    assert result["skipped"] == ["generate", "clean", "sft"]
    assert (run_dir / "eval" / "spa.json").is_file()
