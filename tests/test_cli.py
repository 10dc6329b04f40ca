"""The `spa` command line as a user meets it: help, config, envs, play, and one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from spa_cli.main import app

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, list(args), input=input)


def test_help_lists_every_stage_and_helper():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("generate", "clean", "sft", "ppo", "eval", "config", "envs", "play"):
        assert command in result.output


def test_config_show_prints_the_resolved_yaml():
    result = invoke("config", "show", "--set", "rollout.groups=3", "--set", "env.name=sudoku")
    assert result.exit_code == 0
    shown = yaml.safe_load(result.output)
    assert shown["rollout"]["groups"] == 3 and shown["env"]["name"] == "sudoku"


@pytest.mark.parametrize("args, message", [
    (["config", "show", "--set", "rollout.grups=3"], "error: unknown config key 'rollout.grups'"),
    (["config", "show", "--config", "missing.yaml"], "error: config file missing.yaml does not exist"),
    (["play", "--env", "sokobn"], "error: unknown env 'sokobn'; choose one of: sokoban"),
    (["play", "--env", "sokoban", "--actions", "Up || Jump"], "error: not an action in sokoban: 'Jump'"),
    (["play", "--env", "sokoban", "--actions", ""], "error: not an action in sokoban: ''"),
])
def test_user_errors_are_one_line_with_exit_code_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith(message), result.output
    assert "Traceback" not in result.output


def test_envs_lists_the_games(monkeypatch):
    from spa_cli import main

    monkeypatch.setattr(main.console, "width", 250)
    result = invoke("envs")
    assert result.exit_code == 0
    for name in ("sokoban", "sokoban_hard", "frozen_lake", "frozen_lake_6x6", "sudoku", "sokoban_2boxes",
                 "sokoban_grid_vocab", "sokoban_action_vocab", "countdown", "qa"):
        assert f"│ {name} " in result.output
    # each game's own moves and budget, free-form ones included
    for moves in ("North | South | West | East / 10", "r,c,v (1-indexed) / 50", "one equation / 1",
                  "the final answer / 1"):
        assert moves in result.output
    assert "world_model, base / coords, text" in result.output and "world_model, base / text " in result.output


def test_play_scripted_actions_show_reward_and_state():
    import envs

    game = envs.make("frozen_lake", is_slippery=False)
    text, _ = game.reset(seed=3)
    result = invoke("play", "--env", "frozen_lake", "--seed", "3", "--actions", "Left")
    assert result.exit_code == 0
    assert result.output.startswith(text)
    assert "> Left  reward" in result.output


def test_play_interactive_reprompts_on_garbage_and_quits():
    result = invoke("play", "--env", "sudoku", "--seed", "1", input="nonsense\nq\n")
    assert result.exit_code == 0
    assert "not understood: 'nonsense'" in result.output


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "spa_cli", "--help"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0 and "generate" in out.stdout


# ---- games from elsewhere (--env module:Class) ----------------------------------------------------

def test_env_import_path_errors_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "spa_cli_half_game.py").write_text("class Half:\n    name = 'half'\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = str(tmp_path / "t.jsonl")
    for env, message in [
        ("spa_cli_no_such_module:Game", ("error: env 'spa_cli_no_such_module:Game': cannot import "
                                         "'spa_cli_no_such_module': ModuleNotFoundError")),
        ("spa_cli_half_game:Half", ("error: env 'spa_cli_half_game:Half' does not follow the game API (see "
                                    "envs/base.py); it lacks: action_names, legend, max_actions_per_traj, "
                                    "reset, step, render, render_text, instruction, parse_action, "
                                    "sample_action, a render_mode argument of __init__")),
    ]:
        result = invoke("generate", "--env", env, "--backend", "random", "--out", out)
        assert result.exit_code == 2 and "Traceback" not in result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(message), result.output


def test_generate_plays_a_game_given_as_an_import_path(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # where examples/ is
    out = tmp_path / "t.jsonl"
    result = invoke("generate", "--env", "examples.double_or_add:DoubleOrAdd", "--backend", "random",
                    "--groups", "2", "--group-size", "2", "--out", str(out), "-q")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(row["id"] for row in rows) == [f"examples.double_or_add:DoubleOrAdd-{seed}-{sample}"
                                                 for seed in (10000, 10001) for sample in (0, 1)]
    assert rows[0]["turns"][0]["state"].startswith("Value: 1; target: ")


def test_model_loads_draw_no_tqdm_bars_beside_spa_progress(tiny_model_dir, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_DISABLE_PROGRESS_BARS"}
    out = tmp_path / "t.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "spa_cli", "generate", "--model", str(tiny_model_dir), "--groups", "1",
         "--group-size", "1", "--set", "rollout.max_new_tokens=4", "--set", "rollout.max_turns=1", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert len(out.read_text().splitlines()) == 1
    assert "Loading weights" not in result.stderr and "it/s]" not in result.stderr, result.stderr
