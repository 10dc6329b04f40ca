"""Names of the games, their default settings, and their gymnasium ids.

`make("sokoban", num_boxes=2)` builds a game by name with overrides; the same games are registered
with gymnasium (`gymnasium.make("spa/Sokoban-v0")`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import gymnasium

from envs.base import EnvError, TextGameEnv


@dataclass(frozen=True)
class EnvSpec:
    name: str
    gym_id: str
    entry_point: str  # "module:Class"
    kwargs: dict[str, Any] = field(default_factory=dict)
    summary: str = ""

    def load_class(self) -> type[TextGameEnv]:
        module, cls = self.entry_point.split(":")
        return getattr(importlib.import_module(module), cls)


SPECS: dict[str, EnvSpec] = {
    spec.name: spec
    for spec in [
        EnvSpec("sokoban", "spa/Sokoban-v0", "envs.sokoban:SokobanEnv",
                {"dim": 6, "num_boxes": 1, "max_steps": 100},
                "Sokoban 6x6, 1 box (the paper's setting)"),
        EnvSpec("sokoban_hard", "spa/SokobanHard-v0", "envs.sokoban:SokobanEnv",
                {"dim": 10, "num_boxes": 2, "max_steps": 100},
                "Sokoban 10x10, 2 boxes (generalisation test)"),
        EnvSpec("sokoban_2boxes", "spa/Sokoban2Boxes-v0", "envs.sokoban:SokobanEnv",
                {"dim": 6, "num_boxes": 2, "max_steps": 100},
                "Sokoban 6x6, 2 boxes (SPA's Sokoban2Boxes)"),
        EnvSpec("sokoban_grid_vocab", "spa/SokobanDifferentGridVocab-v0", "envs.sokoban:SokobanEnv",
                {"dim": 6, "num_boxes": 1, "max_steps": 100,
                 "symbols": {"wall": "W", "empty": ".", "target": "G", "box on target": "C", "box": "B",
                             "player": "A", "player on target": "@"}},
                "Sokoban 6x6 drawn with other symbols (SPA's SokobanDifferentGridVocab)"),
        EnvSpec("sokoban_action_vocab", "spa/SokobanDifferentActionVocab-v0", "envs.sokoban:SokobanEnv",
                {"dim": 6, "num_boxes": 1, "max_steps": 100,
                 "actions": {"Up": "North", "Down": "South", "Left": "West", "Right": "East"}},
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
    return list(SPECS)


def spec(name: str) -> EnvSpec:
    if name not in SPECS:
        close = difflib.get_close_matches(name, SPECS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise EnvError(f"unknown env {name!r}; choose one of: {', '.join(SPECS)}.{hint}")
    return SPECS[name]


def make(name: str, **overrides: Any) -> TextGameEnv:
    """Build the game `name` with its registered defaults updated by `overrides`."""
    env_spec = spec(name)
    cls = env_spec.load_class()
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for key in overrides:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise EnvError(f"env {name!r} has no option {key!r}; options: {', '.join(accepted)}.{hint}")
    return cls(**{**env_spec.kwargs, **overrides})


def register_with_gymnasium() -> None:
    for env_spec in SPECS.values():
        if env_spec.gym_id not in gymnasium.registry:
            gymnasium.register(id=env_spec.gym_id, entry_point=env_spec.entry_point,
                               kwargs=dict(env_spec.kwargs), disable_env_checker=True)
