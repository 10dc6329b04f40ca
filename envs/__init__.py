"""The text games of SPA, in pure Python (no torch): Sokoban, FrozenLake and Sudoku."""

from envs.base import PROMPT_MODES, RENDER_MODES, EnvError, TextGameEnv
from envs.registry import SPECS, make, names, register_with_gymnasium, spec

register_with_gymnasium()

__all__ = ["PROMPT_MODES", "RENDER_MODES", "SPECS", "EnvError", "TextGameEnv", "make", "names", "spec"]
