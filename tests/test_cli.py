"""The `spa` command line as a user meets it: help, config, envs, play, and one-line errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from spa_cli.main import app

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, list(args), input=input)


def help_at(width: int, *path: str) -> list[str]:
    """The lines of `spa PATH --help` on a terminal `width` columns wide."""
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def paragraphs(text: str) -> list[str]:
    """`text`'s paragraphs as a reader sees them: each on one line, spaces collapsed."""
    return [" ".join(block.split()) for block in re.split(r"\n\s*\n", text) if block.strip()]


def test_help_lists_every_command_in_recipe_order_with_a_one_line_summary():
    lines = help_at(200)
    listed = [line.split()[1] for line in lines if re.match(r"│ [a-z]+ {2,}\S", line)]
    assert listed == ["generate", "clean", "sft", "ppo", "eval", "pipeline", "probe", "plot", "view", "plan", "envs",
                      "play", "config"]
    for path, command in commands():
        summary = paragraphs(command.help)[0]
        assert len(summary) <= 100, (path, summary)  # a summary, not a description
        parent = help_at(200, *path[:-1])
        assert any(re.search(rf"│ {path[-1]} +{re.escape(summary)} +│$", line) for line in parent), (path, parent)


def test_help_text_wraps_where_the_terminal_does_not_where_the_source_lines_end():
    import typer

    root = typer.main.get_command(app)
    for path, command in [((), root), *commands()]:
        texts = [command.help, *(getattr(param, "help", None) for param in command.params)]
        wanted = [paragraph for text in texts if text for paragraph in paragraphs(text)]
        wide = help_at(400, *path)
        for paragraph in wanted:  # each paragraph in one line when the terminal has room
            assert any(paragraph in line for line in wide), (path, paragraph)
        narrow = help_at(60, *path)
        assert max(map(len, narrow)) <= 60, (path, narrow)
        before_panels = " ".join(line.strip() for line in narrow[:next(
            i for i, line in enumerate(narrow) if line.startswith("╭"))])
        for paragraph in paragraphs(command.help or ""):  # wrapped, every word kept
            assert paragraph in before_panels, (path, paragraph)


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


@pytest.mark.parametrize("interrupted_while", ["running", "reporting a lost peer"])
def test_an_interrupt_ends_with_the_resume_hint_even_while_an_error_is_reported(interrupted_while, monkeypatch,
                                                                                  capsys):
    """A launcher SIGTERMs (KeyboardInterrupt, `_stop_on_sigterm`) the other ranks when one dies,
    and may do so while a rank is still reporting the collective its peer broke: the hint must
    come out either way (typer would otherwise turn the interrupt into a silent exit 130)."""
    import typer

    from spa_cli import main
    from stages.common import distributed

    def stage(resume: bool = False):
        raise KeyboardInterrupt if interrupted_while == "running" else RuntimeError("Connection closed by peer")

    def sigterm_now(err):
        raise KeyboardInterrupt

    monkeypatch.setattr(distributed, "lost_peer", sigterm_now)
    with pytest.raises(typer.Exit) as stopped:
        main.user_errors(stage)(resume=False)
    assert stopped.value.exit_code == 130
    assert capsys.readouterr().err.strip() == "interrupted; run the same command again with --resume to resume"


def test_a_launched_rank_waits_for_the_others_and_exits_at_once_after_a_stage_that_succeeded(monkeypatch):
    """Left to the interpreter's exit, gloo's C++ threads can abort a finished rank: a stage that
    succeeded waits at a barrier for the other ranks, then ends its process with status 0 (only in
    a launched run of several ranks; one process keeps its group for the next stage)."""
    import torch

    from spa_cli import main
    from stages.common import distributed

    calls = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(distributed.os, "_exit", lambda status: calls.append(f"exit {status}"))
    # a stage run earlier in this process keeps its one-rank group (`distributed`), which serves
    # ours; a group made here is ours to end
    made_here = not torch.distributed.is_initialized()
    if made_here:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setenv("WORLD_SIZE", "1")
        assert main.user_errors(lambda: "done")() == "done" and calls == []
        monkeypatch.setenv("WORLD_SIZE", "2")
        main.user_errors(lambda: calls.append("stage"))()
        assert calls == ["stage", "barrier", "exit 0"]
        calls.clear()
        with pytest.raises(typer.Exit) as failed:
            main.user_errors(lambda: main._fail("bad input"))()
        assert failed.value.exit_code == 2 and calls == []  # a failed stage neither waits nor exits early
    finally:
        if made_here:
            torch.distributed.destroy_process_group()


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


# ---- the conveniences: version, completion, defaults in --help, machine-readable output --------------


def test_version():
    from importlib import metadata

    result = invoke("--version")
    assert (result.exit_code, result.output) == (0, f"spa {metadata.version('spa')}\n")


def test_bash_completion_script_completes_commands_and_flags(tmp_path):
    spa = Path(sys.executable).parent / "spa"
    # --show-completion takes no shell name: it asks shellingham for the nearest shell among its
    # ancestors, which a test run need not have (a launcher's `sh -c`, a job whose shell has
    # exited). Run from bash, as a user types it (`; exit` keeps bash from exec'ing spa in its place).
    proc = subprocess.run(["bash", "-c", f"'{spa}' --show-completion; exit $?"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    assert "complete -o default -F _spa_completion spa" in script
    (tmp_path / "spa.bash").write_text(script)

    def complete(*words: str) -> list[str]:
        line = (f'source {tmp_path / "spa.bash"}; COMP_WORDS=({" ".join(words)}); '
                f'COMP_CWORD={len(words) - 1}; _spa_completion spa; printf "%s\\n" "${{COMPREPLY[@]}}"')
        env = {**os.environ, "PATH": f"{spa.parent}:{os.environ['PATH']}"}
        return subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, check=True).stdout.split()

    assert sorted(complete("spa", "pl")) == ["plan", "play", "plot"]
    assert complete("spa", "generate", "--group") == ["--groups", "--group-size"]
    assert complete("spa", "eval", "comp") == ["compare"]


def commands(group=None, path=()):
    """Every (path, click command) of the app, sub-commands included."""
    import typer

    group = group or typer.main.get_command(app)
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield (*path, name), command  # a group with options of its own (eval)
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


NO_DEFAULT = {"help", "version", "install_completion", "show_completion"}


def help_records():
    """(command path, option, help text) for every option of every command."""
    import typer

    root = typer.main.get_command(app)
    for path, command in commands():
        ctx = command.make_context(" ".join(path), [], parent=root.make_context("spa", [], resilient_parsing=True),
                                   resilient_parsing=True)
        for param in command.params:
            if param.param_type_name == "option" and param.name not in NO_DEFAULT:
                yield path, param, param.get_help_record(ctx)[1]


def test_every_flags_help_shows_the_default_it_resolves_to():
    from stages.common.config import default_of, yaml_text

    seen = 0
    for path, param, text in help_records():
        assert "[default: " in text, (path, param.name, text)
        found = re.search(r"\[default: \((\w+(?:\.\w+)+): (.*)\)\]$", text)
        if found:  # a shorthand for a config key: the key and its built-in default
            key, shown = found.groups()
            assert shown == yaml_text(default_of(key)), (path, param.name)
            seen += 1
    assert seen > 40


class Captured(Exception):
    """Raised by a stage's stand-in with the config the command built."""


def other_value(key: str):
    """A valid value for config key `key` that differs from its default, and the flag's text."""
    import typing

    from stages.common.config import SPAConfig, default_of

    section, name = key.split(".")
    hint = typing.get_type_hints(type(getattr(SPAConfig(), section)))[name]
    default = default_of(key)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return next(a for a in args if a != default)
    if typing.get_origin(hint) is list:
        return ["tensorboard"]
    if isinstance(default, bool):
        return not default
    if isinstance(default, float):
        return default + 0.5
    if isinstance(default, int) or int in args:
        return (default or 2) + 1
    return f"{default}-other"


@pytest.mark.parametrize("stage", ["generate", "clean", "sft", "ppo", "evaluate", "pipeline"])
def test_each_shorthand_sets_the_config_key_its_help_names(stage, monkeypatch):
    import importlib

    from stages.common.config import default_of

    module = importlib.import_module(f"stages.{stage}")

    def capture(config, **_):
        raise Captured(config)

    monkeypatch.setattr(module, "run", capture)
    command = {"evaluate": ("eval",)}.get(stage, (stage,))
    for path, param, text in help_records():
        found = re.search(r"\[default: \((\w+(?:\.\w+)+): .*\)\]$", text)
        if path != command or not found:
            continue
        key = found.group(1)
        value = other_value(key)
        if isinstance(value, bool):
            args = [param.opts[0] if value else param.secondary_opts[0]]
        else:
            args = [arg for item in (value if isinstance(value, list) else [value]) for arg in (param.opts[0], str(item))]
        result = invoke(*command, *args)
        assert isinstance(result.exception, Captured), (key, result.output)
        config = result.exception.args[0]
        got = config
        for part in key.split("."):
            got = getattr(got, part)
        assert got == value != default_of(key), (key, args)


def test_envs_as_json_names_every_game():
    import envs as registry

    result = invoke("envs", "--json")
    assert result.exit_code == 0
    games = json.loads(result.output)
    assert [game["name"] for game in games] == registry.names()
    sokoban = games[0]
    assert sokoban == {"name": "sokoban", "gym_id": "spa/Sokoban-v0", "settings": registry.spec("sokoban").kwargs,
                       "actions": "Up | Down | Left | Right", "max_actions_per_traj": 10,
                       "prompt_modes": ["world_model", "base"], "render_modes": ["coords", "text"],
                       "summary": registry.spec("sokoban").summary}
    assert invoke("envs", "--format", "json").output == result.output
    markdown = invoke("envs", "--format", "markdown").output.splitlines()
    assert markdown[0] == "| name | gymnasium id | settings | actions / turn budget | prompt / render modes | what |"
    assert markdown[2].startswith("| sokoban | spa/Sokoban-v0 | dim=6, num_boxes=1, max_steps=100 | Up \\| Down")
    assert invoke("envs", "--format", "yaml").stderr == "error: --format must be table, json or markdown, got 'yaml'\n"


@pytest.mark.parametrize("columns", ["40", "200"])
def test_tables_never_cut_a_name_when_redirected_or_narrow(tmp_path, columns):
    import envs as registry

    reports = []
    for name in ("a_report_with_a_rather_long_name_that_would_not_fit", "b"):
        path = tmp_path / "a_directory_with_a_long_name_too" / f"{name}.json"
        result = invoke("eval", "--backend", "random", "--seeds", "2", "--pass-k", "1", "--out", str(path), "-q")
        assert result.exit_code == 0, result.output
        reports.append(str(path))
    env = {**os.environ, "COLUMNS": columns}
    for args, names in [(["envs"], [*registry.names(), *(registry.spec(n).gym_id for n in registry.names())]),
                        (["eval", "compare", *reports], reports)]:
        with (tmp_path / "out.txt").open("w") as handle:  # redirected: not a terminal
            subprocess.run([sys.executable, "-m", "spa_cli", *args], stdout=handle, env=env, check=True)
        text = (tmp_path / "out.txt").read_text()
        for name in names:
            assert re.search(rf"│ {re.escape(name)} +│", text), (name, text[:2000])
        assert "…" not in text
    assert "(%, as the paper's tables)" in text and "x10^-2" not in text


def test_compare_as_json_and_markdown(tmp_path):
    paths = []
    for name, seeds in (("a", 3), ("b", 3)):
        path = tmp_path / f"{name}.json"
        assert invoke("eval", "--backend", "random", "--seeds", str(seeds), "--pass-k", "2", "--out", str(path),
                      "-q", "--set", f"rollout.sample_seed={len(paths)}").exit_code == 0
        paths.append(str(path))
    from stages.evaluation.reports import compare_rows

    rows = json.loads(json.dumps(compare_rows(paths)))  # tuples as lists, as JSON has them
    result = invoke("eval", "compare", *paths, "--json")
    assert result.exit_code == 0 and json.loads(result.output) == rows
    markdown = invoke("eval", "compare", *paths, "--format", "markdown").output.splitlines()
    assert markdown[0] == (f"| report | model | prompt, states | Pass@1 | Pass@2 | obs exact | pred exact | pred exact, changed | "
                           f"changed: grid / coords | obs cells | pred cells | "
                           f"Pass@1 minus {paths[0]} | Pass@2 minus {paths[0]} |")
    diff, low, high = rows[1]["pass@1_vs_first"]
    assert markdown[3].startswith(f"| {paths[1]} | random | base, coords | {100 * rows[1]['pass@1']:.1f} |")
    assert markdown[3].endswith(f"| {100 * diff:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] | "
                                f"{tables_difference(rows[1]['pass@k_vs_first'])} |")


def tables_difference(paired):
    diff, low, high = (100 * value for value in paired)
    return f"{diff:+.1f} [{low:+.1f}, {high:+.1f}]"


# ---- spa play: any game of the config, and why a move changed nothing --------------------------------


def test_play_takes_the_config_so_qa_with_its_file_is_playable(tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "What is 2 + 2?", "answer": 4}) + "\n")
    config = tmp_path / "qa.yaml"
    config.write_text(f"env:\n  name: qa\n  options: {{path: {questions}}}\n")
    result = invoke("play", "--config", str(config), "--actions", "4")
    assert result.exit_code == 0, result.output
    assert result.output == "Question: What is 2 + 2?\n> 4  reward +1\nQuestion: What is 2 + 2?\nAnswer: 4 (correct)\ndone: solved\n"
    result = invoke("play", "--env", "qa", "--set", f"env.options.path={questions}", "--actions", "5")
    assert result.exit_code == 0 and "Answer: 5 (wrong)\ndone: failed" in result.output
    result = invoke("play", "--env", "qa")
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and "path" in result.stderr


def test_play_says_why_a_move_changed_nothing():
    import envs

    game = envs.make("sudoku")
    game.reset(seed=1)
    clue = next((r, c) for r in range(4) for c in range(4) if game.puzzle[r][c])
    empty = next((r, c) for r in range(4) for c in range(4) if not game.board[r][c])
    row_values = {v for v in game.board[empty[0]] if v}
    taken = min(row_values)  # already in the empty cell's row
    moves = [f"{clue[0] + 1},{clue[1] + 1},1", f"{empty[0] + 1},{empty[1] + 1},{taken}"]
    result = invoke("play", "--env", "sudoku", "--seed", "1", "--actions", " || ".join(moves))
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith(">")]
    assert lines[0] == f"> {moves[0]}  reward +0  (no effect: ({clue[0] + 1},{clue[1] + 1}) is a clue)"
    assert lines[1].startswith(f"> {moves[1]}  reward +0  (no effect: {taken} is already in the row")
    # Sokoban seed 0: the player at (2,4) under a wall, the box at (2,3) two cells from the left wall
    result = invoke("play", "--seed", "0", "--actions", "Left || Left || Left || Right || Up || Up")
    moves = [line for line in result.output.splitlines() if line.startswith(">")]
    assert moves == ["> Left  reward -0.1", "> Left  reward -0.1",
                     "> Left  reward -0.1  (no effect: the box cannot move that way)", "> Right  reward -0.1",
                     "> Up  reward -0.1", "> Up  reward -0.1  (no effect: a wall is in the way)"]


def test_clean_shows_the_base_prompt_on_the_share_asked(tmp_path):
    data, out = str(tmp_path / "t.jsonl"), str(tmp_path / "sft.jsonl")
    assert invoke("generate", "--backend", "random", "--groups", "4", "--group-size", "1", "--out", data,
                  "-q").exit_code == 0
    result = invoke("clean", "--data", data, "--out", out, "--base-prompt-fraction", "0.75", "-q",
                    "--set", "clean.val_fraction=0")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in Path(out).read_text(encoding="utf-8").splitlines()]
    assert sum("<think> [Your thoughts] </think>" in row["messages"][1]["content"] for row in rows) == 3
    result = invoke("clean", "--data", data, "--out", out, "--base-prompt-fraction", "1.5")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if line.strip()] == [
        "error: clean.base_prompt_fraction must be >= 0 and <= 1, got 1.5"]
