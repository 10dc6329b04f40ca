"""Games from elsewhere: `module:Class` import paths, the `spa.envs` entry points, the API check, and
the example game of docs/games.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import envs
from envs.base import EnvError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "examples.double_or_add:DoubleOrAdd"

# A complete game that does not subclass TextGameEnv, and classes that fall short of the API.
PLUGIN_SOURCE = '''
import random

from envs import TextGameEnv


class Coin:
    """Guess the side of a coin (duck-typed: no TextGameEnv)."""

    name = "coin"
    action_names = ("Heads", "Tails")
    legend = None
    max_actions_per_traj = 1

    def __init__(self, render_mode="coords", bias=0.5):
        self.render_mode, self.bias, self.side, self.guess = render_mode, bias, "Heads", None

    def reset(self, *, seed=None, options=None):
        self.side = "Heads" if random.Random(seed).random() < self.bias else "Tails"
        self.guess = None
        return self.render(), {"seed": seed, "success": False}

    def step(self, action):
        self.guess = self.parse_action(action)
        won = self.guess == self.side
        info = {"success": won, "action_is_valid": self.guess is not None, "action_is_effective": True}
        return self.render(), float(won), self.guess is not None, False, info

    def render(self):
        return self.render_text(self.render_mode == "coords")

    def render_text(self, coordinates):
        return "Coin: hidden" if self.guess is None else f"Coin: {self.side}"

    def instruction(self, prompt_mode):
        return "Guess the coin."

    def parse_action(self, text):
        return next((a for a in self.action_names if a.lower() == text.strip().lower()), None)

    def sample_action(self, rng):
        return rng.choice(self.action_names)


class NoStep:
    name = "nostep"
    action_names = None
    legend = None
    max_actions_per_traj = 1

    def __init__(self):
        pass

    def reset(self, *, seed=None, options=None):
        return "", {}

    def render(self):
        return ""


class Forgetful(TextGameEnv):
    """Subclasses TextGameEnv but writes neither _step nor its own moves nor a base instruction."""

    instructions = {"world_model": "Play."}

    def _reset(self, rng):
        pass

    def render_grid(self):
        return ""

    def coordinate_line(self):
        return ""


NOT_A_CLASS = 3
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The module `spa_test_plugin` (PLUGIN_SOURCE) on the import path."""
    (tmp_path / "spa_test_plugin.py").write_text(PLUGIN_SOURCE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "spa_test_plugin", raising=False)
    return "spa_test_plugin"


# ---- import paths ------------------------------------------------------------------------------

def test_a_duck_typed_class_plays_by_import_path(plugin):
    env = envs.make(f"{plugin}:Coin", bias=1.0)
    assert env.reset(seed=3) == ("Coin: hidden", {"seed": 3, "success": False})
    assert env.step("heads") == ("Coin: Heads", 1.0, True, False,
                                 {"success": True, "action_is_valid": True, "action_is_effective": True})
    assert envs.spec(f"{plugin}:Coin").entry_point == f"{plugin}:Coin"


@pytest.mark.parametrize("path, message", [
    ("spa_no_such_module:Game",
     ("env 'spa_no_such_module:Game': cannot import 'spa_no_such_module': ModuleNotFoundError: "
      "No module named 'spa_no_such_module'")),
    ("{plugin}:Missing", "env '{plugin}:Missing': module '{plugin}' has no class 'Missing'"),
    ("{plugin}:NOT_A_CLASS", "env '{plugin}:NOT_A_CLASS': module '{plugin}' has no class 'NOT_A_CLASS'"),
    ("{plugin}:", "env '{plugin}:' is not an import path of the form package.module:ClassName"),
    (":Coin", "env ':Coin' is not an import path of the form package.module:ClassName"),
    ("{plugin}:NoStep", ("env '{plugin}:NoStep' does not follow the game API (see envs/base.py); it "
                         "lacks: step, render_text, instruction, parse_action, sample_action, "
                         "a render_mode argument of __init__")),
    ("{plugin}:Forgetful", ("env '{plugin}:Forgetful' does not follow the game API (see envs/base.py); it "
                            "lacks: _step, parse_action (a game without action_names parses its own "
                            "moves), sample_action (a game without action_names draws its own moves), "
                            "instructions['base']")),
])
def test_what_cannot_be_played_is_one_env_error(plugin, path, message):
    with pytest.raises(EnvError) as caught:
        envs.make(path.format(plugin=plugin))
    assert str(caught.value) == message.format(plugin=plugin)


def test_a_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "spa_broken_plugin.py").write_text("1 / 0\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvError, match="^env 'spa_broken_plugin:Game': cannot import 'spa_broken_plugin': "
                                       "ZeroDivisionError: division by zero$"):
        envs.make("spa_broken_plugin:Game")


def test_options_of_an_imported_class_are_checked(plugin):
    with pytest.raises(EnvError, match="has no option 'bais'.*Did you mean 'bias'"):
        envs.make(f"{plugin}:Coin", bais=1.0)


def test_unknown_names_point_to_import_paths():
    expected = ("unknown env 'sokobn'; choose one of: sokoban, .*countdown, qa, or give a game class as "
                "module:ClassName. Did you mean 'sokoban'")
    with pytest.raises(EnvError, match=expected):
        envs.make("sokobn")


def test_the_console_script_finds_a_game_in_the_current_directory(tmp_path):
    """`spa` (a console script) does not put the current directory on sys.path as `python -m` does."""
    (tmp_path / "spa_cwd_game.py").write_text(PLUGIN_SOURCE, encoding="utf-8")
    spa = Path(sys.executable).parent / "spa"
    result = subprocess.run([str(spa), "generate", "--env", "spa_cwd_game:Coin", "--backend", "random",
                             "--groups", "2", "--group-size", "1", "--out", "t.jsonl", "-q"],
                            cwd=tmp_path, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [row["env"] for row in rows] == ["spa_cwd_game:Coin"] * 2


# ---- entry points ------------------------------------------------------------------------------

@pytest.fixture
def installed_plugin(plugin, tmp_path, monkeypatch):
    """A distribution on sys.path whose entry points name the plugin's game, and one clashing name."""
    info = tmp_path / "spa_test_games-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: spa-test-games\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[spa.envs]\ncoin = {plugin}:Coin\nsokoban = {plugin}:Coin\n")
    return plugin


def test_entry_points_register_names(installed_plugin):
    assert envs.names()[-1] == "coin" and envs.names().count("sokoban") == 1
    assert envs.make("coin", bias=0.0).reset(seed=1)[0] == "Coin: hidden"
    assert envs.spec("coin").entry_point == f"{installed_plugin}:Coin"
    assert envs.spec("sokoban").entry_point == "envs.sokoban:SokobanEnv"  # built-in names win


# ---- docs/games.md's example game --------------------------------------------------------------

GAMES_PAGE = REPO / "docs" / "games.md"


def documented_example() -> str:
    page = GAMES_PAGE.read_text(encoding="utf-8")
    section = page[page.index("## Your own game"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_games_page_shows_the_example_game_as_it_is():
    assert documented_example() == (REPO / "examples" / "double_or_add.py").read_text(encoding="utf-8")


def test_the_example_game_plays_exactly(monkeypatch):
    monkeypatch.chdir(REPO)
    env = envs.make(EXAMPLE)
    text, _ = env.reset(seed=0)
    target = env.target
    assert text == f"Value: 1; target: {target}\n{target - 1} to go." and 5 <= target <= 40
    assert env.step("double") == (f"Value: 2; target: {target}\n{target - 2} to go.", 0.0, False, False,
                                  {"success": False, "action_is_valid": True, "action_is_effective": True})
    assert env.step("Jump")[4] == {"success": False, "action_is_valid": False, "action_is_effective": False}
    env.reset(seed=0)
    # Read the target in binary after its leading 1: each digit doubles, and a 1 adds one.
    actions = [move for bit in bin(target)[3:] for move in ["Double"] + ["Add one"] * (bit == "1")]
    *_, last = [env.step(action) for action in actions]
    assert last == (f"Value: {target}; target: {target}\n0 to go.", 1.0, True, False,
                    {"success": True, "action_is_valid": True, "action_is_effective": True})
    assert env.reset(seed=0)[0] == text and env.step("Add one")[0].startswith("Value: 2;")


def test_the_games_page_commands_run_on_the_example(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from spa_cli.main import app

    section = GAMES_PAGE.read_text(encoding="utf-8").split("## Your own game")[1]
    commands = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1).splitlines()
    assert commands[0].startswith(f"spa generate --env {EXAMPLE} --backend random")
    monkeypatch.chdir(REPO)
    for command in commands:
        args = command.replace("runs/", f"{tmp_path}/").split()[1:]
        result = CliRunner().invoke(app, [*args, "-q"])
        assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "double.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(row["env"] == EXAMPLE and row["turns"] for row in rows)
    assert (tmp_path / "double_sft.jsonl").read_text()
