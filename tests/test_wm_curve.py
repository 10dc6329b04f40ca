"""experiments/wm_curve/wm_curve.py: its cost accounting (a point that starts from an earlier SFT run has cost that
run's tokens too, so the curve places a self-play round at both rounds' tokens) and what it measures
a checkpoint on (the tuning rooms, never the eval seeds)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_wm_curve():
    spec = importlib.util.spec_from_file_location("wm_curve", ROOT / "experiments" / "wm_curve" / "wm_curve.py")
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


def test_a_checkpoint_is_measured_on_the_tuning_rooms_with_the_prompt_asked(tmp_path, monkeypatch):
    from stages import evaluate

    wm_curve = load_wm_curve()
    seen = []
    monkeypatch.setattr(evaluate, "run", lambda config: seen.append(config) or {"metrics": {"pass@1": 0.25}})
    args = wm_curve.build_parser().parse_args(["--eval-seeds", "8", "--tuning-seed", "20000"])
    metrics = wm_curve.measure(args, ["env.name=sokoban"], tmp_path / "epoch-2", "base", tmp_path / "base.json")
    assert metrics == {"pass@1": 0.25}
    (config,) = seen
    assert (config.eval.prompt_mode, config.eval.seeds, config.eval.first_seed, config.eval.pass_k) == ("base", 8, 20000, 1)
    assert config.model.name == str(tmp_path / "epoch-2") and config.eval.out == str(tmp_path / "base.json")



def test_prediction_errors_are_told_apart_by_kind(tmp_path):
    from envs.sokoban import SokobanEnv

    wm_curve = load_wm_curve()
    room = "######\n#____#\n#_PX_#\n#__O_#\n#____#\n######"
    state = SokobanEnv.from_grid(room).render()

    def after(action):
        env = SokobanEnv.from_grid(room)
        env.step(action)
        return env.render()

    pushed, up = after("Right"), after("Up")  # Right pushes the box, Up walks
    grid, coordinates = pushed.rsplit("\n", 1)
    written = {
        "exact": pushed,
        "another_action": up,
        "coordinates_wrong": f"{grid}\nPlayer (P) is at (1,1); box (X) is at (2,4); target (O) is at (3,3).",
        "another_actions_grid": f"{up.rsplit(chr(10), 1)[0]}\n{coordinates}",
        "misshapen_grid": pushed.replace("#__PX#", "#__PX##"),
        "wrong_grid": pushed.replace("#__O_#", "#_O__#"),
    }
    turns = [{"state": state, "next_state": pushed, "executed": ["Right"], "prediction": text}
             for text in written.values()]
    turns += [{"state": state, "next_state": pushed, "executed": ["Right"], "prediction": None},  # not counted
              {"state": state, "next_state": pushed, "executed": ["Right", "Up"], "prediction": pushed}]
    # the episode's reports write model text unescaped: a U+2028 in a response is not a line end
    turns[0]["response"] = "<think> \u2028 </think>"
    path = tmp_path / "eval.trajectories.jsonl"
    path.write_text(json.dumps({"render_mode": "coords", "turns": turns}, ensure_ascii=False) + "\n")
    assert [wm_curve.prediction_error(turn, "coords") for turn in turns[:6]] == list(written)
    assert wm_curve.prediction_errors(path) == dict.fromkeys(wm_curve.ERROR_KINDS, 1)


def test_frozen_lake_ceiling_is_the_likeliest_outcome_of_the_slips(tmp_path):
    """Slippery ice: the intended direction and its two neighbours, 1/3 each; the edge keeps the
    player in place and a hole ends the walk."""
    from envs.frozen_lake import FrozenLakeEnv

    wm_curve = load_wm_curve()

    def state(player, holes):
        env = FrozenLakeEnv(size=4)
        env.holes, env.goal, env.start, env.player = set(holes), (3, 3), (0, 0), player
        return env.render()

    corner = {"state": state((0, 0), []), "executed": ["Left"], "next_state": state((1, 0), [])}
    corner["prediction"] = corner["next_state"]  # exact
    # Left from the corner: Up and Left bump the edges (stay, 2/3), Down slips to (1,0) (1/3).
    assert sorted(wm_curve.outcome_chances(corner)) == pytest.approx([1 / 3, 2 / 3])
    walk = {"state": state((0, 0), [(1, 0)]), "executed": ["Down", "Right"], "next_state": state((0, 1), [(1, 0)]),
            "prediction": state((0, 0), [(1, 0)])}  # not exact
    # Down: stay / hole / (0,1), 1/3 each; then Right from each. The hole keeps its 1/3 and gains
    # 1/9 from (0,0); (0,1) is reached twice (1/9 + 1/9); (0,0), (1,1) and (0,2) once each.
    assert sorted(wm_curve.outcome_chances(walk)) == pytest.approx([1 / 9, 1 / 9, 1 / 9, 2 / 9, 4 / 9])
    path = tmp_path / "eval.trajectories.jsonl"
    path.write_text(json.dumps({"turns": [corner, walk, {**walk, "prediction": None}]}) + "\n")
    ceiling = wm_curve.prediction_ceiling(path)
    assert ceiling.keys() == {"1", "2", "all"} and ceiling["1"]["turns"] == ceiling["2"]["turns"] == 1
    assert ceiling["all"]["turns"] == 2 and ceiling["all"]["best_possible"] == pytest.approx(500 / 9)
    assert (ceiling["1"]["model_exact"], ceiling["2"]["model_exact"]) == (100.0, 0.0)
    assert [ceiling[k]["best_possible"] for k in "12"] == pytest.approx([200 / 3, 400 / 9])
    assert [ceiling[k]["true_distribution_sampled"] for k in "12"] == pytest.approx([500 / 9, 2300 / 81])
