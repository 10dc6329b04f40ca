"""The text-game API every `spa` environment follows.

A game is a `gymnasium.Env` whose observations and actions are strings:

* ``reset(seed=s)`` -> ``(text, info)``: the same seed gives the same puzzle on every machine and
  Python version (all randomness comes from ``random.Random(seed)``, whose output is stable).
* ``step(action)`` -> ``(text, reward, terminated, truncated, info)`` with ``info["success"]``,
  ``info["action_is_valid"]`` (the text was understood) and ``info["action_is_effective"]`` (the
  state changed). An action that cannot be parsed or is not allowed changes nothing, and then
  ``info["no_effect"]`` says why in a few words ("a wall is in the way", "(1,2) is a clue"), which
  `spa play` shows.
* ``render()`` returns the same text as the last observation.

Each game also carries what a prompt needs (action names, symbol legend, instruction texts), so
the prompt code builds from the env instead of hard-coding one game.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import gymnasium
from gymnasium import spaces

RENDER_MODES = ("coords", "text")
PROMPT_MODES = ("world_model", "base")

# Printable ASCII plus the two non-ASCII symbols of SPA's grids and newline.
_CHARSET = frozenset(chr(c) for c in range(32, 127)) | {"\n", "√"}


class EnvError(ValueError):
    """A user-caused env problem (unknown name, bad option); the CLI prints it as one line."""


class TextGameEnv(gymnasium.Env):
    """Base class of the text games.

    Subclasses set the class attributes below and implement `_reset`, `_step`, `render_grid`
    and `coordinate_line`; this class does the gymnasium bookkeeping shared by all games.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": list(RENDER_MODES)}

    #: Registry name, e.g. "sokoban".
    name: ClassVar[str] = ""
    #: Canonical action names the model may write (e.g. Up/Down/Left/Right); None for free-form
    #: moves (Sudoku's "r,c,v").
    action_names: ClassVar[tuple[str, ...] | None] = None
    #: How a free-form move is written, for listings such as `spa envs` (Sudoku: "r,c,v").
    move_format: ClassVar[str] = ""
    #: Grid symbol -> meaning, shown to the model as a legend; None when the game has none.
    legend: ClassVar[dict[str, str] | None] = None
    #: Instruction texts quoted from the SPA configs, one per prompt mode.
    instructions: ClassVar[dict[str, str]] = {}
    #: The agent loop's budget of primitive actions per episode (SPA's max_actions_per_traj).
    max_actions_per_traj: ClassVar[int] = 10

    def __init__(self, render_mode: str = "coords"):
        if render_mode not in RENDER_MODES:
            raise EnvError(f"render_mode must be one of {', '.join(RENDER_MODES)}, got {render_mode!r}")
        self.render_mode = render_mode
        self.observation_space = spaces.Text(max_length=4096, charset=_CHARSET)
        self.action_space = spaces.Text(max_length=256, charset=_CHARSET)
        self._seed: int | None = None

    # ---- gymnasium API -------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        if seed is None:
            seed = random.SystemRandom().randrange(2**31)
        self._seed = seed
        self._reset(random.Random(seed))
        return self.render(), {"seed": seed, "success": False}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        reward, terminated, truncated, info = self._step(action)
        return self.render(), float(reward), terminated, truncated, info

    def render(self) -> str:
        return self.render_text(coordinates=self.render_mode == "coords")

    # ---- text ----------------------------------------------------------------------------

    def render_text(self, coordinates: bool) -> str:
        """The grid, followed by the coordinate line when ``coordinates`` is true and the game has one
        (a game without coordinates returns an empty `coordinate_line`)."""
        grid = self.render_grid()
        line = self.coordinate_line() if coordinates else ""
        return f"{grid}\n{line}" if line else grid

    def instruction(self, prompt_mode: str) -> str:
        if prompt_mode not in PROMPT_MODES:
            raise EnvError(f"prompt_mode must be one of {', '.join(PROMPT_MODES)}, got {prompt_mode!r}")
        return self.instructions[prompt_mode]

    # ---- for subclasses ------------------------------------------------------------------

    def parse_action(self, text: str) -> str | None:
        """Canonical form of an action text (e.g. " up " -> "Up"), or None if not understood."""
        assert self.action_names is not None, "free-form games override parse_action"
        wanted = text.strip().lower()
        return next((name for name in self.action_names if name.lower() == wanted), None)

    def sample_action(self, rng: random.Random) -> str:
        """A uniformly random action text (the paper's random-action baseline)."""
        assert self.action_names is not None, "free-form games override sample_action"
        return rng.choice(self.action_names)

    def _reset(self, rng: random.Random) -> None:
        raise NotImplementedError

    def _step(self, action: str) -> tuple[float, bool, bool, dict]:
        """Apply one action; return (reward, terminated, truncated, info)."""
        raise NotImplementedError

    def render_grid(self) -> str:
        """The state as the model sees it in render mode "text"."""
        raise NotImplementedError

    def coordinate_line(self) -> str:
        """The line render mode "coords" adds under the grid; "" for a game without one."""
        raise NotImplementedError
