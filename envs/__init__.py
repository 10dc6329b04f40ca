"""The text games of SPA, in pure Python (no torch): Sokoban and its variants, FrozenLake, Sudoku,
Countdown and QA; and games from elsewhere, by import path or entry point (`envs.registry`)."""

from envs.base import PROMPT_MODES, RENDER_MODES, EnvError, TextGameEnv, prompt_modes, render_modes
from envs.registry import SPECS, make, names, register_with_gymnasium, spec

register_with_gymnasium()

__all__ = ["PROMPT_MODES", "RENDER_MODES", "SPECS", "EnvError", "TextGameEnv", "make", "names", "prompt_modes",
           "render_modes", "spec"]
