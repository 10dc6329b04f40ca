"""Names of the games, their default settings, their gymnasium ids, and games from elsewhere.

`make("sokoban", num_boxes=2)` builds a game by name with overrides; the same games are registered
with gymnasium (`gymnasium.make("spa/Sokoban-v0")`).

A game that is not built in is found two ways, so every stage can play it:

* an import path ``"package.module:ClassName"`` (``spa generate --env mygame:MyGame``), imported
  like ``python -m`` would from the current directory (which is searched after installed packages);
* a name registered by an installed package in the ``spa.envs`` entry-point group, e.g. in its
  ``pyproject.toml``: ``[project.entry-points."spa.envs"] mygame = "mygame:MyGame"``. Built-in
  names win over entry points.

Such a class must follow the game API: subclass `envs.base.TextGameEnv` and write its hooks, or
provide everything the stages use itself (`API_ATTRIBUTES`, `API_METHODS`, a ``render_mode``
argument). A class that falls short is refused with one `EnvError` line naming what it lacks.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import gymnasium

from envs.base import EnvError, TextGameEnv

ENTRY_POINT_GROUP = "spa.envs"

#: What the stages use of a game (rollout, clean, evaluate, the random backend, the prompts).
#: Attributes may be None where the game has none (legend, action_names).
API_ATTRIBUTES = ("name", "action_names", "legend", "max_actions_per_traj")
API_METHODS = ("reset", "step", "render", "render_text", "instruction", "parse_action", "sample_action")
#: What a TextGameEnv subclass writes itself; the base class provides the rest of the API.
SUBCLASS_HOOKS = ("_reset", "_step", "render_grid", "coordinate_line")


@dataclass(frozen=True)
class EnvSpec:
    name: str
    gym_id: str
    entry_point: str  # "module:Class"
    kwargs: dict[str, Any] = field(default_factory=dict)
    summary: str = ""

    def load_class(self) -> type[TextGameEnv]:
        """The game class, checked against the API; an import or API problem is one EnvError."""
        cls = import_class(self.entry_point)
        check_api(cls, self.entry_point)
        return cls


_SOKOBAN = {"dim": 6, "num_boxes": 1, "max_steps": 100}

SPECS: dict[str, EnvSpec] = {
    spec.name: spec
    for spec in [
        EnvSpec("sokoban", "spa/Sokoban-v0", "envs.sokoban:SokobanEnv", dict(_SOKOBAN),
                "Sokoban 6x6, 1 box (the paper's setting)"),
        EnvSpec("sokoban_hard", "spa/SokobanHard-v0", "envs.sokoban:SokobanEnv",
                {"dim": 10, "num_boxes": 2, "max_steps": 100},
                "Sokoban 10x10, 2 boxes (generalisation test)"),
        EnvSpec("sokoban_2boxes", "spa/Sokoban2Boxes-v0", "envs.sokoban:SokobanEnv",
                {**_SOKOBAN, "num_boxes": 2},
                "Sokoban 6x6, 2 boxes (SPA's Sokoban2Boxes)"),
        EnvSpec("sokoban_grid_vocab", "spa/SokobanDifferentGridVocab-v0", "envs.sokoban:SokobanEnv",
                {**_SOKOBAN, "symbols": {"wall": "W", "empty": ".", "target": "G", "box on target": "C",
                                         "box": "B", "player": "A", "player on target": "@"}},
                "Sokoban 6x6 drawn with other symbols (SPA's SokobanDifferentGridVocab)"),
        EnvSpec("sokoban_action_vocab", "spa/SokobanDifferentActionVocab-v0", "envs.sokoban:SokobanEnv",
                {**_SOKOBAN, "actions": {"Up": "North", "Down": "South", "Left": "West", "Right": "East"}},
                "Sokoban 6x6 with other move names (SPA's SokobanDifferentActionVocab)"),
        EnvSpec("frozen_lake", "spa/FrozenLake-v0", "envs.frozen_lake:FrozenLakeEnv",
                {"size": 4, "p": 0.8, "is_slippery": True},
                "FrozenLake 4x4, slippery, random start and goal"),
        EnvSpec("frozen_lake_6x6", "spa/FrozenLake6x6-v0", "envs.frozen_lake:FrozenLakeEnv",
                {"size": 6, "p": 0.8, "is_slippery": True},
                "FrozenLake 6x6 (the paper's setting for Qwen2.5-3B)"),
        EnvSpec("sudoku", "spa/Sudoku-v0", "envs.sudoku:SudokuEnv",
                {"difficulty": "easy"},
                "Sudoku 4x4, unique solution, 6 blanks"),
        EnvSpec("countdown", "spa/Countdown-v0", "envs.countdown:CountdownEnv",
                {"count": 4, "max_number": 20, "max_target": 100},
                "Countdown: reach the target from 4 numbers with + - * / (one answer)"),
        EnvSpec("qa", "spa/QA-v0", "envs.qa:QAEnv", {},
                "Questions with final answers from a JSONL file (needs option path)"),
    ]
}


def names() -> list[str]:
    """The built-in games, then those installed packages register (entry points)."""
    return list(SPECS) + [name for name in _entry_point_specs() if name not in SPECS]


def spec(name: str) -> EnvSpec:
    """The spec of a built-in name, an import path "module:Class", or an entry-point name."""
    if name in SPECS:
        return SPECS[name]
    if ":" in name:
        return EnvSpec(name, "", name)
    plugins = _entry_point_specs()
    if name in plugins:
        return plugins[name]
    known = names()
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise EnvError(f"unknown env {name!r}; choose one of: {', '.join(known)}, or give a game class as "
                   f"module:ClassName.{hint}")


def make(name: str, **overrides: Any) -> TextGameEnv:
    """Build the game `name` with its registered defaults updated by `overrides`."""
    env_spec = spec(name)
    cls = env_spec.load_class()
    parameters = inspect.signature(cls.__init__).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        accepted = [p.name for p in parameters if p.name != "self"]
        for key in overrides:
            if key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise EnvError(f"env {name!r} has no option {key!r}; options: {', '.join(accepted)}.{hint}")
    return cls(**{**env_spec.kwargs, **overrides})


def import_class(path: str) -> type:
    """The class named by "package.module:ClassName"; any failure is one EnvError line."""
    module_name, _, class_name = path.partition(":")
    if not module_name or not class_name:
        raise EnvError(f"env {path!r} is not an import path of the form package.module:ClassName")
    try:
        module = _import_module(module_name)
    except Exception as err:  # noqa: BLE001 - whatever the user's module raises, report it in one line
        raise EnvError(f"env {path!r}: cannot import {module_name!r}: {type(err).__name__}: {err}") from None
    cls = getattr(module, class_name, None)
    if not inspect.isclass(cls):
        raise EnvError(f"env {path!r}: module {module_name!r} has no class {class_name!r}")
    return cls


def _import_module(module_name: str) -> Any:
    """Import a module, looking in the current directory last if it is not found elsewhere."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # A console script, unlike `python -m`, does not search the current directory.
        missing_is_ours = err.name is not None and (module_name + ".").startswith(err.name + ".")
        if not missing_is_ours or os.getcwd() in sys.path:
            raise
        sys.path.append(os.getcwd())
        return importlib.import_module(module_name)


def check_api(cls: type, label: str) -> None:
    """Refuse a class the stages could not play, naming everything it lacks."""
    missing = [attr for attr in API_ATTRIBUTES if not hasattr(cls, attr)]
    missing += [method for method in API_METHODS if not callable(getattr(cls, method, None))]
    parameters = inspect.signature(cls.__init__).parameters.values()
    takes_render_mode = any(p.name == "render_mode" or p.kind is p.VAR_KEYWORD for p in parameters)
    if cls.__init__ is object.__init__ or not takes_render_mode:  # object's (*args, **kwargs) takes none
        missing.append("a render_mode argument of __init__")
    if issubclass(cls, TextGameEnv):
        missing += [hook for hook in SUBCLASS_HOOKS if getattr(cls, hook) is getattr(TextGameEnv, hook)]
        if cls.action_names is None and cls.parse_action is TextGameEnv.parse_action:
            missing.append("parse_action (a game without action_names parses its own moves)")
        if cls.action_names is None and cls.sample_action is TextGameEnv.sample_action:
            missing.append("sample_action (a game without action_names draws its own moves)")
        if cls.instruction is TextGameEnv.instruction:
            missing += [f"instructions[{mode!r}]" for mode in cls.prompt_modes if mode not in cls.instructions]
    if missing:
        raise EnvError(f"env {label!r} does not follow the game API (see envs/base.py); it lacks: "
                       f"{', '.join(missing)}")


def _entry_point_specs() -> dict[str, EnvSpec]:
    """Games that installed packages register in the "spa.envs" entry-point group."""
    found = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(point.name, EnvSpec(point.name, "", point.value, summary=f"from {point.value}"))
    return found


def register_with_gymnasium() -> None:
    for env_spec in SPECS.values():
        if env_spec.gym_id not in gymnasium.registry:
            gymnasium.register(id=env_spec.gym_id, entry_point=env_spec.entry_point,
                               kwargs=dict(env_spec.kwargs), disable_env_checker=True)
