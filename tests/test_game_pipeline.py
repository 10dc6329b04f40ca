"""The new games through the unchanged stages: random-policy generate, ground-truth clean, eval.

For every game, the states `spa clean` writes into `<observation>` and `<prediction>` must be the
states the env itself produces when the episode's executed actions are replayed on its seed.
"""

from __future__ import annotations

import json
import random
import re

import pytest

import envs
from stages import clean, evaluate, generate
from stages.common import artifacts
from stages.common.config import SPAConfig, load_config
from stages.evaluation import metrics
from stages.evaluation.reports import trajectories_path

GAMES = ["sokoban_2boxes", "sokoban_grid_vocab", "sokoban_action_vocab", "countdown", "qa"]
QUESTIONS = [
    {"question": "What is 2 + 2?", "answer": "4"},
    {"question": "How many legs do 3 spiders have?", "answer": 24},
    {"question": "Write one half as a fraction.", "answer": "1/2"},
]


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS), encoding="utf-8")
    return str(path)


def game_options(name: str, questions_file: str) -> dict:
    return {"path": questions_file} if name == "qa" else {}


def render_mode(name: str) -> str:
    """Countdown and QA have no coordinates; the others render them."""
    return "text" if name in ("countdown", "qa") else "coords"


def pipeline_config(tmp_path, name: str, options: dict) -> SPAConfig:
    config = SPAConfig()
    config.quiet = True
    config.env.name, config.env.options = name, options
    config.rollout.backend = "random"
    config.generate.render_mode = render_mode(name)
    config.rollout.groups, config.rollout.group_size = 3, 2
    config.generate.out = str(tmp_path / "trajectories.jsonl")
    config.clean.data, config.clean.out = config.generate.out, str(tmp_path / "sft.jsonl")
    config.clean.val_fraction = 0.0
    return config


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def replayed_states(name: str, options: dict, trajectory: dict) -> list[tuple[str, str]]:
    """(state, next_state) of each turn, from the env replaying the turn's executed actions."""
    env = envs.make(name, render_mode=render_mode(name), **options)
    env.reset(seed=trajectory["seed"])
    states = []
    for turn in trajectory["turns"]:
        before = env.render()
        for action in turn["executed"]:
            env.step(action)
        states.append((before, env.render()))
    return states


def tag_contents(tag: str, text: str) -> list[str]:
    return re.findall(f"<{tag}>(.*?)</{tag}>", text, re.DOTALL)


@pytest.mark.parametrize("name", GAMES)
def test_generate_then_clean_writes_the_envs_true_states(tmp_path, name, questions_file):
    options = game_options(name, questions_file)
    config = pipeline_config(tmp_path, name, options)
    generate.run(config)
    trajectories = {row["id"]: row for row in read_rows(config.generate.out)}
    assert len(trajectories) == 6
    summary = clean.run(config)
    rows = read_rows(config.clean.out)
    assert summary["rows"] == len(rows) == 6  # the random policy always writes the format
    for row in rows:
        trajectory = trajectories[row["source_id"]]
        truth = replayed_states(name, options, trajectory)
        assert [(t["state"], t["next_state"]) for t in trajectory["turns"]] == truth
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert len(answers) == len(truth)
        for content, (state, next_state) in zip(answers, truth):
            assert tag_contents("observation", content) == [state]
            assert tag_contents("prediction", content) == [next_state]


@pytest.mark.parametrize("name", ["sokoban_grid_vocab", "sokoban_action_vocab"])
def test_random_coordinates_rewrite_only_the_numbers_in_other_vocabularies(tmp_path, name):
    config = pipeline_config(tmp_path, name, {})
    config.clean.random_coordinates = True
    generate.run(config)
    trajectories = {row["id"]: row for row in read_rows(config.generate.out)}
    clean.run(config)
    coordinate = re.compile(r"\((\d+),(\d+)\)")
    moved = 0
    for row in read_rows(config.clean.out):
        turns = trajectories[row["source_id"]]["turns"]
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        for content, turn in zip(answers, turns):
            (observation,) = tag_contents("observation", content)
            assert coordinate.sub("(#,#)", observation) == coordinate.sub("(#,#)", turn["state"])
            moved += observation != turn["state"]
    assert moved > 0


def test_world_model_accuracy_on_other_symbols():
    env = envs.make("sokoban_grid_vocab")
    state = env.reset(seed=4)[0]
    next_state = env.step(env.sample_action(random.Random(0)))[0]
    grid_rows = state.split("\n")[:-1]
    wrong_cell = "\n".join(["X" + grid_rows[0][1:], *grid_rows[1:]])  # one of 36 cells wrong
    turns = [{"observation": state, "state": state, "prediction": next_state, "next_state": next_state},
             {"observation": wrong_cell, "state": state, "prediction": None, "next_state": next_state}]
    figures = metrics.world_model_metrics([{"turns": turns}])
    assert figures["observation"]["exact_match"] == 0.5
    assert figures["observation"]["cell_accuracy"] == pytest.approx((1 + 35 / 36) / 2)
    assert figures["prediction"] == {"turns": 1, "coverage": 0.5, "exact_match": 1.0, "cell_accuracy": 1.0,
                                     "grid_exact": 1.0, "coordinates_exact": 1.0}
    assert metrics.grid_cells(state) == [list(row) for row in grid_rows]


@pytest.mark.parametrize("name", GAMES)
def test_random_baseline_eval_runs_on_every_new_game(tmp_path, name, questions_file):
    options = game_options(name, questions_file)
    sets = [f"eval.out={tmp_path / 'report.json'}", "rollout.backend=random", "eval.seeds=2", "eval.n=2",
            "eval.pass_k=2", "quiet=true", f"env.name={name}", "eval.prompt_mode=world_model",
            f"eval.render_mode={render_mode(name)}"]
    sets += [f"env.options.{key}={value}" for key, value in options.items()]
    report = evaluate.run(load_config(None, sets))
    figures = report["metrics"]
    assert figures["episodes"] == 4 and figures["format_valid_rate"] == 1.0
    assert figures["world_model"]["observation"]["coverage"] == 1.0
    assert report["settings"]["env"] == name
    played, _ = artifacts.read_jsonl(trajectories_path(tmp_path / "report.json"))
    assert len(played) == 4
