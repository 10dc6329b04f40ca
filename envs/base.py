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

Modes. A game says which it supports: render modes in gymnasium's ``metadata["render_modes"]``
("coords": the grid plus its coordinate line, SPA's text_with_coordinates; "text": the grid
alone) and prompt modes in ``prompt_modes`` ("world_model": the agent writes `<observation>` and
`<prediction>`; "base": think, then answer). A game without coordinates (Countdown, QA) renders
"text" only; a game with no world-model prompt has no states for the agent to write. Its
instruction may depend on the render mode (`instruction`): a text that promises coordinates is
only shown when they are rendered.
"""

from __future__ import annotations

import copy
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
    #: The prompt modes this game has instructions for.
    prompt_modes: ClassVar[tuple[str, ...]] = PROMPT_MODES

    #: Registry name, e.g. "sokoban".
    name: ClassVar[str] = ""
    #: Canonical action names the model may write (e.g. Up/Down/Left/Right); None for free-form
    #: moves (Sudoku's "r,c,v").
    action_names: ClassVar[tuple[str, ...] | None] = None
    #: How a free-form move is written, for listings such as `spa envs` (Sudoku: "r,c,v").
    move_format: ClassVar[str] = ""
    #: Grid symbol -> meaning, shown to the model as a legend; None when the game has none.
    legend: ClassVar[dict[str, str] | None] = None
    #: Instruction texts quoted from the SPA configs, one per prompt mode, for the "coords" render.
    instructions: ClassVar[dict[str, str]] = {}
    #: The same for the "text" render (no coordinate shown, so none promised); None: `instructions`.
    text_instructions: ClassVar[dict[str, str] | None] = None
    #: The agent loop's budget of primitive actions per episode (SPA's max_actions_per_traj).
    max_actions_per_traj: ClassVar[int] = 10
    #: What an action can do, as `action_effect` names it (e.g. Sokoban's "push"); empty for a
    #: game with no world-model prompt.
    action_effects: ClassVar[tuple[str, ...]] = ()

    def __init__(self, render_mode: str = "coords"):
        supported = render_modes(type(self))
        if render_mode not in supported:
            raise EnvError(f"{self.name or type(self).__name__} has no render mode {render_mode!r}; "
                           f"its render modes: {', '.join(supported)}")
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
        """The instruction of `prompt_mode` for this env's render mode."""
        if prompt_mode not in self.prompt_modes:
            raise EnvError(f"{self.name} has no {prompt_mode!r} prompt; its prompt modes: "
                           f"{', '.join(self.prompt_modes)}")
        texts = self.instructions
        if self.render_mode != "coords" and self.text_instructions is not None:
            texts = self.text_instructions
        return texts[prompt_mode]

    # ---- what an action would do (for probing a world model) -------------------------------

    def probe_actions(self) -> list[str]:
        """The actions to ask a world model about in the current state: every action name."""
        assert self.action_names is not None, "free-form games override probe_actions"
        return list(self.action_names)

    def action_effect(self, action: str) -> str:
        """What `action` would do from the current state, one of `action_effects`; nothing changes."""
        raise NotImplementedError(f"{self.name} does not name its actions' effects")

    def next_states(self, action: str) -> list[str]:
        """The rendered states `action` can lead to from the current one, the intended (no-slip)
        outcome first; a deterministic game has one. Nothing changes."""
        trial = copy.deepcopy(self)
        trial.step(action)
        return [trial.render()]

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


def render_modes(game: Any) -> tuple[str, ...]:
    """The render modes a game class (or instance) supports; a duck-typed game that does not say
    supports both."""
    return tuple(getattr(game, "metadata", {}).get("render_modes", RENDER_MODES))


def prompt_modes(game: Any) -> tuple[str, ...]:
    """The prompt modes a game class (or instance) supports; a duck-typed game that does not say
    supports both."""
    return tuple(getattr(game, "prompt_modes", PROMPT_MODES))
