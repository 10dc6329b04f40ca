"""`spa pipeline`: each arm's resolved settings, the shared stages and their ids, the dry run, and
the whole run end to end on a tiny random model (artifacts, the Table-2-like summary with paired
differences, skipping completed stages, rerunning what a changed setting touches, continuing
after a crash)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spa_cli.main import app
from stages import pipeline
from stages.common import rss
from stages.common.config import PAPER_ARMS, load_config
from stages.common.errors import UserError
from stages.evaluation import metrics

BASE = "smollm2-135m"


def plan_of(*arms, sets=()):
    arm_list = "[" + ", ".join(arms) + "]"
    return pipeline.plan(load_config(None, [f"pipeline.arms={arm_list}", "pipeline.dir=/nonexistent/run", *sets]))


def chain(the_plan, arm):
    """The arm's stages as (name, facts): what each starts from and shows the model."""
    facts = []
    stage = the_plan.rows[arm]
    while stage is not None:
        cfg = stage.config
        fact = {"model": cfg.model.name}
        if stage.kind == "generate":
            fact |= {"modes": (cfg.generate.prompt_mode, cfg.generate.render_mode), "backend": cfg.rollout.backend}
        if stage.kind == "clean":
            fact = {"states": cfg.clean.states, "random_coordinates": cfg.clean.random_coordinates,
                    "filter_format": cfg.clean.filter_format, "data": cfg.clean.data}
        if stage.kind == "sft":
            fact |= {"epochs": cfg.sft.epochs, "state_text": cfg.sft.state_text, "data": cfg.sft.data}
        if stage.kind == "ppo":
            fact |= {"modes": (cfg.ppo.prompt_mode, cfg.ppo.render_mode), "state_reward": cfg.ppo.state_reward,
                     "advantage": cfg.ppo.advantage}
        if stage.kind == "eval":
            fact |= {"modes": (cfg.eval.prompt_mode, cfg.eval.render_mode)}
        facts.insert(0, (stage.name, fact))
        stage = stage.upstream
    return facts


R = "/nonexistent/run"
SELF_PLAY = ("generate/selfplay", {"model": BASE, "modes": ("world_model", "coords"), "backend": "hf"})


def cleaned(name, data="selfplay", states="ground_truth", random_coordinates=False, filter_format=True):
    return (f"clean/{name}", {"states": states, "random_coordinates": random_coordinates,
                              "filter_format": filter_format, "data": f"{R}/data/{data}.jsonl"})


def tuned(name, clean, epochs=5, state_text="trained"):
    return (f"sft/{name}", {"model": BASE, "epochs": epochs, "state_text": state_text,
                            "data": f"{R}/sft_data/{clean}.jsonl"})


def rl(name, start, modes=("base", "coords"), state_reward="none", advantage="gae"):
    return (f"ppo/{name}", {"model": start, "modes": modes, "state_reward": state_reward, "advantage": advantage})


def evaluated(name, model, modes=("base", "coords")):
    return (f"eval/{name}", {"model": model, "modes": modes})


def spa_like(name, clean="selfplay", sft=None, generate=SELF_PLAY, **options):
    sft = sft or name
    clean_options = {k: v for k, v in options.items() if k in ("states", "random_coordinates", "filter_format")}
    sft_options = {k: v for k, v in options.items() if k in ("epochs", "state_text")}
    data = generate[0].split("/")[1]
    modes = options.get("modes", ("base", "coords"))
    return [generate, cleaned(clean, data, **clean_options), tuned(sft, clean, **sft_options),
            rl(name, f"{R}/sft/{sft}/final", modes), evaluated(name, f"{R}/ppo/{name}/final", modes)]


EXPECTED = {
    "base": [evaluated("base", BASE, ("base", "text"))],
    "state_estimation": [evaluated("state_estimation", BASE)],
    "vanilla_rl": [rl("vanilla_rl", BASE, ("base", "text")),
                   evaluated("vanilla_rl", f"{R}/ppo/vanilla_rl/final", ("base", "text"))],
    "state_estimation_rl": [rl("state_estimation_rl", BASE),
                            evaluated("state_estimation_rl", f"{R}/ppo/state_estimation_rl/final")],
    "vagen": [rl("vagen", BASE, ("world_model", "coords"), "cells", "bilevel_gae"),
              evaluated("vagen", f"{R}/ppo/vagen/final", ("world_model", "coords"))],
    "spa_sft": [SELF_PLAY, cleaned("selfplay"), tuned("spa", "selfplay"),
                evaluated("spa_sft", f"{R}/sft/spa/final")],
    "spa": spa_like("spa"),
    "spa_masked": spa_like("spa_masked", state_text="masked"),
    "spa_format_control": spa_like("spa_format_control", state_text="placeholder"),
    "spa_random_coordinates": spa_like("spa_random_coordinates", clean="selfplay_random_coordinates",
                                       random_coordinates=True),
    "spa_no_state_estimation": spa_like(
        "spa_no_state_estimation", clean="selfplay_text", modes=("base", "text"),
        generate=("generate/selfplay_text", {"model": BASE, "modes": ("world_model", "text"), "backend": "hf"})),
    "spa_self_belief": spa_like("spa_self_belief", clean="selfplay_self_belief", states="self_belief"),
    "rand_sft": spa_like("rand_sft", clean="random",
                         generate=("generate/random", {"model": BASE, "modes": ("world_model", "coords"),
                                                       "backend": "random"})),
    "spa_sft_1_epoch": spa_like("spa_sft_1_epoch", epochs=1),
    "spa_unfiltered": spa_like("spa_unfiltered", clean="selfplay_unfiltered", filter_format=False),
}


def test_every_built_in_arm_resolves_to_the_papers_settings():
    assert list(EXPECTED) == list(pipeline.BUILT_IN)
    the_plan = plan_of(*pipeline.BUILT_IN)
    for arm in pipeline.BUILT_IN:
        assert chain(the_plan, arm) == EXPECTED[arm], arm
    # every stage once, upstream before downstream
    names = [stage.name for stage in the_plan.stages]
    assert len(names) == len(set(names)) == 45
    assert all(names.index(s.upstream.name) < names.index(s.name) for s in the_plan.stages if s.upstream)
    shared = {stage.name: stage.arms for stage in the_plan.stages}
    assert shared["sft/spa"] == ["spa_sft", "spa"]
    assert shared["generate/selfplay"] == ["spa_sft", "spa", "spa_masked", "spa_format_control", "spa_random_coordinates",
                                           "spa_self_belief", "spa_sft_1_epoch", "spa_unfiltered"]
    # the plan's own settings: the data is 160 puzzles x 8, PPO and eval as base.yaml says
    generate = next(s for s in the_plan.stages if s.name == "generate/selfplay").config
    assert (generate.rollout.groups, generate.rollout.group_size) == (160, 8)
    assert pipeline.describe_stage(next(s for s in the_plan.stages if s.name == "ppo/vagen"))["size"] == (
        "1000 steps of 32 x 8 episodes, state reward cells (0.5/0.5)")


def test_built_in_arms_pin_what_defines_them():
    """Config sections give every other setting; they cannot turn SPA into another arm."""
    the_plan = plan_of(*pipeline.BUILT_IN, sets=["ppo.render_mode=text", "ppo.state_reward=exact",
                                                 "generate.prompt_mode=base", "eval.render_mode=text",
                                                 "ppo.steps=7"])
    assert all(chain(the_plan, arm) == EXPECTED[arm] for arm in pipeline.BUILT_IN)
    assert {s.config.ppo.steps for s in the_plan.stages if s.kind == "ppo"} == {7}


def test_the_default_arms_are_table_2_and_its_step_0_rows():
    assert load_config(None, []).pipeline.arms == list(PAPER_ARMS)
    the_plan = pipeline.plan(load_config(None, ["pipeline.dir=/nonexistent/run"]))
    assert [arm.label for arm in the_plan.arms] == [
        "base model", "+ State Estimation", "+ Vanilla RL", "+ State Estimation RL", "+ VAGEN", "+ SPA SFT",
        "+ SPA"]
    assert len(the_plan.stages) == 14  # 7 evals, 4 PPO runs, one data + clean + SFT for spa_sft and spa


def test_a_random_data_policy_plays_the_sft_data_with_random_actions():
    the_plan = plan_of("spa", "rand_sft", sets=["pipeline.data_policy=random"])
    generate = the_plan.stages[0]
    assert generate.name == "generate/selfplay" and generate.config.rollout.backend == "random"
    # spa's data is then RandSFT data: the same stages as rand_sft's, run once
    assert [s.name for s in the_plan.stages] == ["generate/selfplay", "clean/selfplay", "sft/spa", "ppo/spa",
                                                 "eval/spa"]
    assert the_plan.rows["rand_sft"] is the_plan.rows["spa"]


def test_the_data_plays_each_puzzle_data_group_size_times():
    spa = plan_of("spa", sets=["pipeline.data_groups=64", "rollout.group_size=2", "ppo.mini_batch=16"])
    once = plan_of("spa", sets=["pipeline.data_groups=64", "rollout.group_size=2", "ppo.mini_batch=16",
                                "pipeline.data_group_size=1"])
    assert [(p.stages[0].config.rollout.groups, p.stages[0].config.rollout.group_size) for p in (spa, once)] == [
        (64, 2), (64, 1)]
    assert once.stages[3].name == "ppo/spa" and once.stages[3].config.rollout.group_size == 2  # PPO's own groups
    assert once.stages[0].key != spa.stages[0].key  # other data: its stages rerun


def test_stage_ids_do_not_depend_on_which_arms_are_listed_or_their_order():
    alone = [s.name for s in plan_of("spa").stages]
    assert alone == ["generate/selfplay", "clean/selfplay", "sft/spa", "ppo/spa", "eval/spa"]
    both = plan_of("spa", "spa_sft")
    assert [s.name for s in both.stages] == [s.name for s in plan_of("spa_sft", "spa").stages]
    assert [arm.name for arm in both.arms] == ["spa", "spa_sft"]  # the table keeps the listed order


def test_a_variant_shares_what_it_does_not_change_and_names_the_rest():
    variant = "{name: spa_3_epochs, like: spa, set: {sft.epochs: 3}, label: SPA 3 epochs}"
    for listed in ([variant], ["spa", variant]):
        the_plan = plan_of(*listed)
        names = [name for name, _ in chain(the_plan, "spa_3_epochs")]
        assert names == ["generate/selfplay", "clean/selfplay", "sft/spa_3_epochs", "ppo/spa_3_epochs",
                         "eval/spa_3_epochs"]
        assert chain(the_plan, "spa_3_epochs")[2][1]["epochs"] == 3
    assert the_plan.arms[1].label == "SPA 3 epochs"


def test_transfer_plays_the_sft_data_on_another_game():
    """Easy2Hard (Fig. 9): SFT on FrozenLake 4x4, PPO and eval on 6x6."""
    the_plan = plan_of("base", "{name: easy2hard, like: spa, data_env: {name: frozen_lake}}",
                       sets=["env.name=frozen_lake_6x6"])
    stages = {stage.name: stage.config for stage in the_plan.stages}
    assert stages["generate/easy2hard"].env.name == stages["clean/easy2hard"].env.name == "frozen_lake"
    assert stages["ppo/easy2hard"].env.name == stages["eval/easy2hard"].env.name == "frozen_lake_6x6"
    assert stages["ppo/easy2hard"].model.name == f"{R}/sft/easy2hard/final"


def test_an_arm_trains_on_its_own_game_and_is_evaluated_on_the_pipelines():
    """Table 6: SPA trained on Sokoban (data, SFT, PPO) and evaluated zero-shot on FrozenLake, the
    game of every row of the table."""
    the_plan = plan_of("base", "{name: from_sokoban, like: spa, train_env: {name: sokoban}}",
                       "{name: wide, like: spa, train_env: {name: sokoban, options: {dim: 7}}, data_env: sokoban}",
                       sets=["env.name=frozen_lake"])
    stages = {stage.name: stage.config for stage in the_plan.stages}
    assert stages["generate/from_sokoban"].env.name == stages["clean/from_sokoban"].env.name == "sokoban"
    assert stages["ppo/from_sokoban"].env.name == "sokoban"
    assert stages["eval/from_sokoban"].env.name == stages["eval/base"].env.name == "frozen_lake"
    assert stages["eval/from_sokoban"].model.name == f"{R}/ppo/from_sokoban/final"
    # data_env still names the SFT data's game (here the same data as from_sokoban's, played once)
    assert "generate/wide" not in stages and "wide" in the_plan.stages[1].arms
    assert stages["ppo/wide"].env.options == {"dim": 7} and stages["eval/wide"].env.name == "frozen_lake"


def test_the_paper_board_of_a_model_is_kept_or_chosen_on_purpose():
    """The paper plays FrozenLake 6x6 with Qwen2.5-3B: its default 4x4 board with that model is
    refused; the 6x6 game, an explicit size, or a smaller model pass."""
    three_b = "model.name=Qwen/Qwen2.5-3B-Instruct"
    with pytest.raises(UserError) as err:
        plan_of("base", sets=["env.name=frozen_lake", three_b])
    assert str(err.value) == (
        "env frozen_lake plays its default board, and the paper plays Qwen/Qwen2.5-3B-Instruct on frozen_lake_6x6 "
        "(its §3); --set env.name=frozen_lake_6x6 plays the paper's board, --set env.options.size=N the board "
        "you choose")
    with pytest.raises(UserError, match="the paper plays Qwen/Qwen2.5-3B-Instruct on frozen_lake_6x6"):
        plan_of("{name: b, model: Qwen/Qwen2.5-3B-Instruct}", sets=["env.name=frozen_lake"])
    for sets in (["env.name=frozen_lake_6x6", three_b], ["env.name=frozen_lake", "env.options.size=4", three_b],
                 ["env.name=frozen_lake", "model.name=Qwen/Qwen2.5-1.5B-Instruct"], ["env.name=sokoban", three_b]):
        assert plan_of("base", sets=sets).rows["base"].config.env.name == sets[0].split("=")[1]


def test_an_arm_can_start_from_a_checkpoint_or_train_on_a_file(tiny_model_dir, tmp_path):
    data = tmp_path / "wm_train.parquet"
    data.write_bytes(b"")
    the_plan = plan_of(f"{{name: released, model: {tiny_model_dir}}}",
                       f"{{name: spa_released_data, like: spa, sft_data: {data}}}")
    assert chain(the_plan, "released") == [evaluated("released", str(tiny_model_dir))]
    assert [name for name, _ in chain(the_plan, "spa_released_data")] == [
        "sft/spa_released_data", "ppo/spa_released_data", "eval/spa_released_data"]
    assert the_plan.stages[1].config.sft.data == str(data)


@pytest.mark.parametrize("arms, sets, says", [
    ("[spaa]", [], "pipeline.arms[0]: unknown arm 'spaa'; built-in arms: base, state_estimation"),
    ("[{name: x, like: vanila_rl}]", [], "pipeline.arms[0].like: unknown arm 'vanila_rl'"),
    ("[spa, spa]", [], "pipeline.arms[1]: arm 'spa' is listed twice"),
    ("[{name: spa, set: {sft.epochs: 1}}]", [], "'spa' is a built-in arm; give the variant another name"),
    ("[{name: x, lke: spa}]", [], "unknown arm key 'lke'; keys: name, like,"),
    ("[{name: x, like: spa, set: {rollout.groups: 2}}]", [], "'rollout.groups' is not a setting of the arm's"),
    ("[{name: x, like: spa, set: {sft.out: y}}]", [], "the pipeline sets sft.out itself"),
    ("[{name: x, like: spa, set: {sft.epoch: 1}}]", [], "arm x: unknown config key 'sft.epoch'"),
    ("[{name: x, like: spa, set: {eval.seeds: 4}}]", [], "arm x sets eval.seeds; every arm is evaluated"),
    ("[{name: x, model: /no/such/model}]", [], "arm x: model '/no/such/model' is not a built-in name"),
    ("[{name: x, like: base, data_env: frozen_lake}]", [], "arm 'x' has no SFT"),
    ("[{name: x, like: spa, train_env: {name: sokoban, size: 4}}]", [], ("unknown config key 'pipeline.arms[0]"
     ".train_env.size'")),
    ("[{name: x, like: spa, train_env: sokobam}]", [], "arm x: unknown env 'sokobam'"),
    ("[{name: x, like: spa, set: {clean.recipe: spa}}]", [], ("arm x: clean.recipe=spa makes SPA's rows, one per "
     "turn split by row; set clean.unit=turn")),
    ("[vagen]", ["env.name=countdown"], "countdown has no 'coords' render mode (ppo.render_mode)"),
    ("[state_estimation]", ["env.name=countdown"],
     "arm state_estimation: countdown has no 'coords' render mode (eval.render_mode)"),
    ("[spa]", ["ppo.mini_batch=3"], "arm spa: ppo.mini_batch=3 does not divide"),
    ("[]", [], "pipeline.arms is empty"),
])
def test_bad_arms_are_one_line(arms, sets, says):
    with pytest.raises(UserError) as err:
        pipeline.plan(load_config(None, [f"pipeline.arms={arms}", "pipeline.dir=/nonexistent/run", *sets]))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    runner = CliRunner()
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["pipeline", "--dry-run", "--dir", str(run_dir), "--set",
                                 "pipeline.arms=[base, spa]"])
    assert result.exit_code == 0, result.output
    assert not run_dir.exists()
    text = result.output
    assert "2 arms, 6 stages" in text
    assert "  sft/spa  [run]  arms: spa" in text and "160 puzzles x 8 = 1280 episodes" in text
    assert "prompt   world_model, states coords" in text and "prompt   base, states text" in text
    result = runner.invoke(app, ["pipeline", "--dry-run", "--json", "--dir", str(run_dir), "--set",
                                 "pipeline.arms=[base, spa]"])
    plan = json.loads(result.output)
    assert [arm["name"] for arm in plan["arms"]] == ["base", "spa"]
    assert plan["arms"][1]["stages"] == ["generate/selfplay", "clean/selfplay", "sft/spa", "ppo/spa", "eval/spa"]
    assert [stage["name"] for stage in plan["stages"] if "memory" not in stage] == ["clean/selfplay"]
    memory = plan["stages"][0].pop("memory")  # its figures: tests/test_memory_plan.py
    assert plan["stages"][0] == {
        "name": "eval/base", "kind": "eval", "arms": ["base"], "env": "sokoban", "model": BASE,
        "prompt_mode": "base", "render_mode": "text", "size": "128 puzzles x 8 samples, Pass@8",
        "output": str(run_dir / "eval" / "base.json"), "status": "run"}
    assert memory["name"] == "eval/base" and memory["fits"] is True
    assert not run_dir.exists()
    result = runner.invoke(app, ["pipeline", "--json"])
    assert result.exit_code == 2 and "use it with --dry-run" in result.output


# ---- end to end, on a tiny model -------------------------------------------------------------------

ARMS = "pipeline.arms=[base, vanilla_rl, spa_sft, spa]"
STAGES = ["eval/base", "ppo/vanilla_rl", "eval/vanilla_rl", "generate/selfplay", "clean/selfplay", "sft/spa",
          "eval/spa_sft", "ppo/spa", "eval/spa"]


def tiny_pipeline(model_dir, run_dir, *extra):
    return load_config(None, [
        f"model.name={model_dir}", f"pipeline.dir={run_dir}", "quiet=true", ARMS,
        "pipeline.data_policy=random", "pipeline.data_groups=3",
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


def test_every_stage_writes_its_artifacts(finished, tiny_model_dir):
    run_dir, result = finished
    assert result["skipped"] == []
    lines = (run_dir / "data" / "selfplay.jsonl").read_text().splitlines()
    assert len(lines) == 6  # data_groups x group_size, played by the random policy
    assert {(json.loads(line)["model"], json.loads(line)["prompt_mode"]) for line in lines} == {
        ("random", "world_model")}
    assert (run_dir / "sft_data" / "selfplay.jsonl").read_text().count("\n") == 6
    for model in ("sft/spa", "ppo/spa", "ppo/vanilla_rl"):
        assert (run_dir / model / "final" / "model.safetensors").is_file()
    reports = {name: json.loads((run_dir / "eval" / f"{name}.json").read_text())
               for name in ("base", "vanilla_rl", "spa_sft", "spa")}
    settings = {name: (r["settings"]["model"], r["settings"]["prompt_mode"], r["settings"]["render_mode"])
                for name, r in reports.items()}
    assert settings == {"base": (str(tiny_model_dir), "base", "text"),
                        "vanilla_rl": (str(run_dir / "ppo" / "vanilla_rl" / "final"), "base", "text"),
                        "spa_sft": (str(run_dir / "sft" / "spa" / "final"), "base", "coords"),
                        "spa": (str(run_dir / "ppo" / "spa" / "final"), "base", "coords")}
    assert {r["metrics"]["episodes"] for r in reports.values()} == {4}  # 2 seeds x 2 samples each
    state = json.loads((run_dir / pipeline.STATE_FILE).read_text())
    assert list(state) == STAGES and all(entry["complete"] for entry in state.values())
    assert all(entry["seconds"] > 0 and entry["resumed"] is False for entry in state.values())
    # each stage's peak RSS: this process's, the high-water mark reset as the stage starts (Linux)
    since = "stage" if rss.reset_peak() else "process"
    assert all(entry["peak_rss_gb"] > 0 and entry["peak_rss_since"] == since for entry in state.values())
    assert result["stages"] == state


def test_the_table_has_one_row_per_arm_with_paired_differences(finished):
    run_dir, result = finished
    table = (run_dir / "table.md").read_text()
    assert table == result["table"]
    grid, note = table.split("\n\n")
    assert note == "PPO: + Vanilla RL after 1 step of 2 x 2 episodes; + SPA after 1 step of 2 x 2 episodes.\n"
    rows = [[cell.strip() for cell in row.split("|")[1:-1]] for row in grid.splitlines()]
    assert rows[0] == ["sokoban", "Pass@1", "Pass@2", "observation exact", "prediction exact",
                       "prediction exact, state changed", "state changed: grid / coordinates exact",
                       "prediction cells", "Pass@1 vs base model [95%]", "Pass@2 vs base model [95%]"]
    assert [row[0] for row in rows[2:]] == ["base model", "+ Vanilla RL", "+ SPA SFT", "+ SPA"]
    base, spa = (json.loads((run_dir / "eval" / f"{n}.json").read_text()) for n in ("base", "spa"))
    assert rows[2][1] == f"{100 * base['metrics']['pass@1']:.1f}" and rows[2][8:] == ["-", "-"]
    diff, low, high = metrics.paired_difference(base["per_seed"], spa["per_seed"], 1)
    assert rows[5][8] == f"{100 * diff:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def test_with_one_sample_a_puzzle_the_table_shows_pass_at_1_once(tmp_path):
    from test_evaluate import write_report

    the_plan = pipeline.plan(load_config(None, [f"pipeline.dir={tmp_path}", "pipeline.arms=[base, state_estimation]",
                                                "eval.pass_k=1"]))
    for name, successes in (("base", [0, 1]), ("state_estimation", [1, 1])):
        out = Path(the_plan.rows[name].config.eval.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        per_seed = [{"seed": seed, "n": 1, "successes": c} for seed, c in zip((123, 124), successes)]
        write_report(out.parent, out.name, sum(successes) / 2, sum(successes) / 2, per_seed=per_seed, n=1, k=1,
                     seeds=2, prompt_mode="base", render_mode="coords" if name != "base" else "text")
    rows = [[cell.strip() for cell in row.split("|")[1:-1]] for row in pipeline.write_table(the_plan).splitlines()]
    assert rows[0] == ["sokoban", "Pass@1", "observation exact", "prediction exact", "prediction exact, state changed",
                       "state changed: grid / coordinates exact", "prediction cells", "Pass@1 vs base model [95%]"]
    assert [row[:2] for row in rows[2:]] == [["base model", "50.0"], ["+ State Estimation", "100.0"]]
    assert rows[3][-1].startswith("+50.0 [")


def test_the_run_directory_gets_its_training_curves_and_pass_at_k_plots(finished):
    from helpers import png_size

    run_dir, _ = finished
    # sft (no validation split): loss, lr -> one row of panels; the PPO runs of one step draw none,
    # their figures are written under the panels
    assert png_size(run_dir / "curves.png") == (1440, 340)
    assert png_size(run_dir / "pass_at_k.png") == (600, 400)


def test_spa_view_of_the_run_directory_holds_its_table_plots_and_eval_episodes(finished, tmp_path):
    from stages.evaluation import viewer

    run_dir, _ = finished
    out = tmp_path / "view.html"
    summary = viewer.write_page(run_dir, out)
    assert summary == f"{out}: 16 episodes (base, spa, spa_sft, vanilla_rl), plots; open it in a browser"
    page = out.read_text()
    assert page.count('src="data:image/png;base64,') == 2  # curves and Pass@k
    assert "<td>+ SPA</td>" in page
    data = json.loads(page.split('id="spa-data">')[1].split("</script>")[0])  # JSON reads \u003c as <
    arms = {}
    for episode in data["episodes"]:
        arms[episode["arm"]] = arms.get(episode["arm"], 0) + 1
    assert arms == {"base": 4, "vanilla_rl": 4, "spa_sft": 4, "spa": 4}


def test_a_second_run_skips_every_completed_stage(finished, tiny_model_dir, capsys):
    run_dir, _ = finished
    before = (run_dir / "sft" / "spa" / "final" / "model.safetensors").stat().st_mtime_ns
    result = pipeline.run(tiny_pipeline(tiny_model_dir, run_dir))
    assert result["skipped"] == STAGES
    shown = capsys.readouterr().out  # shown even with quiet=true, which only hides progress bars
    assert "[pipeline] generate/selfplay: complete, skipped" in shown and result["table"].splitlines()[2] in shown
    assert pipeline.summary(json.loads((run_dir / pipeline.STATE_FILE).read_text())) in shown
    assert (run_dir / "sft" / "spa" / "final" / "model.safetensors").stat().st_mtime_ns == before
    statuses = pipeline.statuses(pipeline.plan(tiny_pipeline(tiny_model_dir, run_dir)))
    assert set(statuses.values()) == {"complete"}


def test_a_changed_setting_reruns_only_the_stages_that_read_it(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    pipeline.run(tiny_pipeline(tiny_model_dir, run_dir, "pipeline.arms=[base, spa]"))
    changed = tiny_pipeline(tiny_model_dir, run_dir, "pipeline.arms=[base, spa]", "sft.lr=2e-4")
    assert pipeline.statuses(pipeline.plan(changed)) == {
        "eval/base": "complete", "generate/selfplay": "complete", "clean/selfplay": "complete", "sft/spa": "run",
        "ppo/spa": "run", "eval/spa": "run"}
    result = pipeline.run(changed)
    # sft changed, so did its checkpoint: PPO from it and its eval rerun; the data does not
    assert result["skipped"] == ["eval/base", "generate/selfplay", "clean/selfplay"]
    # how the random policy draws its data is read by the data stage only, not by the base arm's eval
    for setting in ("rollout.random_reasoning=actions", "rollout.random_moves=effective"):
        redrawn = tiny_pipeline(tiny_model_dir, run_dir, "pipeline.arms=[base, spa]", "sft.lr=2e-4", setting)
        assert pipeline.statuses(pipeline.plan(redrawn)) == {
            "eval/base": "complete", "generate/selfplay": "run", "clean/selfplay": "run", "sft/spa": "run",
            "ppo/spa": "run", "eval/spa": "run"}, setting


def test_a_crash_continues_where_it_stopped(tiny_model_dir, tmp_path, monkeypatch):
    from stages import ppo

    run_dir = tmp_path / "run"
    real_run = ppo.run

    def crash(config):
        raise RuntimeError("power cut")

    monkeypatch.setattr(ppo, "run", crash)
    with pytest.raises(RuntimeError, match="power cut"):
        pipeline.run(tiny_pipeline(tiny_model_dir, run_dir, "pipeline.arms=[spa]"))
    state = json.loads((run_dir / pipeline.STATE_FILE).read_text())
    assert state["ppo/spa"]["complete"] is False and state["sft/spa"]["complete"] is True
    assert pipeline.statuses(pipeline.plan(tiny_pipeline(tiny_model_dir, run_dir, "pipeline.arms=[spa]")))[
        "ppo/spa"] == "resume"
    monkeypatch.setattr(ppo, "run", real_run)
    result = pipeline.run(tiny_pipeline(tiny_model_dir, run_dir, "pipeline.arms=[spa]"))
    assert result["skipped"] == ["generate/selfplay", "clean/selfplay", "sft/spa"]
    assert (run_dir / "eval" / "spa.json").is_file()


@pytest.mark.parametrize("zero_stage", [0, 2], ids=["plain-torch", "deepspeed-zero2"])
def test_no_model_or_optimizer_outlives_its_stage(tiny_model_dir, tmp_path, monkeypatch, zero_stage):
    """The stages run in one process: whatever a stage loaded is gone before the next one loads."""
    import gc
    import weakref

    import torch
    from transformers import PreTrainedModel

    created: list[weakref.ref] = []

    def track(cls, method, kind=object):
        original = getattr(cls, method)

        def tracked(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if isinstance(self, kind):
                created.append(weakref.ref(self))

        monkeypatch.setattr(cls, method, tracked)

    track(PreTrainedModel, "__init__")  # every model loaded
    track(torch.nn.Module, "__setstate__", PreTrainedModel)  # every model copied (copy.deepcopy)
    track(torch.optim.Optimizer, "__init__")
    left: list[tuple[str, list[str]]] = []
    runner, release = pipeline._runner, pipeline._release_memory

    def watched(kind):
        def run(cfg, resume, console):
            result = runner(kind)(cfg, resume, console)
            release()
            gc.collect()
            left.append((kind, sorted(type(ref()).__name__ for ref in created if ref() is not None)))
            return result
        return run

    monkeypatch.setattr(pipeline, "_runner", watched)
    pipeline.run(tiny_pipeline(tiny_model_dir, tmp_path / "run", "pipeline.arms=[base, spa]",
                               f"sft.zero_stage={zero_stage}", f"ppo.zero_stage={zero_stage}"))
    assert len(created) >= 7  # 2 evals, sft (model, optimizer), ppo (actor, critic, 2 optimizers)
    assert left == [(kind, []) for kind in ("eval", "generate", "clean", "sft", "ppo", "eval")]


def test_the_summary_shows_each_stages_time_and_peak_rss():
    assert pipeline.summary({
        "eval/base": {"complete": True, "seconds": 36.2, "peak_rss_gb": 1.234, "peak_rss_since": "stage"},
        "sft/spa": {"complete": True, "seconds": 805.0, "peak_rss_gb": 4.56, "peak_rss_since": "process"},
        "ppo/spa": {"complete": False},
    }).splitlines() == [
        "[pipeline] stages (wall time, peak RSS):",
        "  eval/base       36s  peak RSS 1.2 GB",
        "  sft/spa      13m25s  peak RSS 4.6 GB (the process's peak so far)",
        "  ppo/spa           -  peak RSS not recorded",
    ]


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "configs" / "gpu").glob("*.yaml")),
                         ids=lambda path: path.name)
def test_every_gpu_config_plans(path):
    the_plan = pipeline.plan(load_config(path, ["pipeline.dir=/nonexistent/run"]))
    assert {row.config.env.name for row in the_plan.rows.values()} == {the_plan.config.env.name}


# ---- the world-model probe of each arm's final model -------------------------------------------------


def test_the_dry_run_lists_one_probe_per_distinct_final_model():
    the_plan = plan_of("base", "state_estimation", "spa_sft", "{name: spa_sft_wm, like: spa_sft, set: "
                       "{eval.prompt_mode: world_model}}", "spa", sets=["eval.probe_states=3"])
    probes = {arm: stage.name for arm, stage in the_plan.probes.items()}
    assert probes == {"base": "probe/base", "state_estimation": "probe/base", "spa_sft": "probe/spa_sft",
                      "spa_sft_wm": "probe/spa_sft", "spa": "probe/spa"}
    models = {stage.name: (stage.config.model.name, stage.config.eval.render_mode, stage.config.eval.out)
              for stage in the_plan.stages if stage.kind == "probe"}
    assert models == {"probe/base": (BASE, "coords", f"{R}/probe/base.json"),
                      "probe/spa_sft": (f"{R}/sft/spa/final", "coords", f"{R}/probe/spa_sft.json"),
                      "probe/spa": (f"{R}/ppo/spa/final", "coords", f"{R}/probe/spa.json")}
    text = pipeline.describe(the_plan)
    assert "  probe/spa_sft  [run]  arms: spa_sft, spa_sft_wm" in text and "3 states, every action of each" in text
    assert [arm["probe"] for arm in the_plan.to_json()["arms"]][:2] == [f"{R}/probe/base.json"] * 2
    assert not plan_of("base", "spa").probes  # off by default
    with pytest.raises(UserError, match="countdown does not name its actions' effects"):
        plan_of("base", sets=["eval.probe_states=1", "env.name=countdown", "eval.render_mode=text"])


def test_the_table_gets_each_arms_probe_and_a_finished_probe_is_not_redone(tiny_model_dir, tmp_path):
    from stages import probe

    run_dir = tmp_path / "run"
    arms = "pipeline.arms=[base, state_estimation, vanilla_rl]"
    result = pipeline.run(tiny_pipeline(tiny_model_dir, run_dir, arms, "eval.probe_states=1"))
    state = json.loads((run_dir / pipeline.STATE_FILE).read_text())
    assert list(state) == ["eval/base", "probe/base", "eval/state_estimation", "ppo/vanilla_rl", "eval/vanilla_rl",
                           "probe/vanilla_rl"]
    rows = [[cell.strip() for cell in row.split("|")[1:-1]] for row in result["table"].splitlines()]
    assert rows[0][8:11] == ["probe exact, state changed", "probe cells, state changed", "probe true > copy"]
    for row, name in zip(rows[2:], ("base", "base", "vanilla_rl")):
        report = probe.load_report(run_dir / "probe" / f"{name}.json")
        assert report["settings"]["states"] == 1 and report["all"]["cases"] == 4
        changed = report["changed"]
        assert row[8:11] == [f"{100 * changed['exact']:.1f}", f"{100 * changed['cells']:.1f}",
                             f"{100 * changed['likelihood']['true_more_likely']:.1f}"]
    assert probe.load_report(run_dir / "probe" / "vanilla_rl.json")["settings"]["model"] == str(
        run_dir / "ppo" / "vanilla_rl" / "final")
    # rerun: nothing is redone; more states: only the probes; off: the evals stay done, the columns go
    assert pipeline.run(tiny_pipeline(tiny_model_dir, run_dir, arms, "eval.probe_states=1"))["skipped"] == list(state)
    more = pipeline.plan(tiny_pipeline(tiny_model_dir, run_dir, arms, "eval.probe_states=2"))
    assert {name for name, status in pipeline.statuses(more).items() if status != "complete"} == {
        "probe/base", "probe/vanilla_rl"}
    off = pipeline.run(tiny_pipeline(tiny_model_dir, run_dir, arms))
    assert off["skipped"] == ["eval/base", "eval/state_estimation", "ppo/vanilla_rl", "eval/vanilla_rl"]
    assert "probe" not in off["table"]
