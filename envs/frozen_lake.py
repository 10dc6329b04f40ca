"""FrozenLake as a text game, following RAGEN's FrozenLake (a gymnasium `FrozenLakeEnv` subclass).

Rules
-----
* The board is ``size`` x ``size``. Each cell is frozen ice with probability ``p``, else a hole.
  Start and goal sit on two random distinct cells (not fixed corners) and are never holes. A map is
  kept only if the goal can be reached from the start over non-hole cells; otherwise it is redrawn.
  Every seed gives a new map (RAGEN's ``reset(seed)`` regenerates the map from the seed).
* Actions are ``Left``, ``Down``, ``Right``, ``Up`` (gymnasium actions 0..3 in that order).
* Slippery ice (the default, as in gymnasium ``is_slippery=True``): the move goes in the intended
  direction or in one of the two perpendicular directions, each with probability 1/3. Without
  slipping it goes where intended. Moving off the board leaves the player where they are.
* Reward 1 on reaching the goal, else 0. The episode terminates in a hole or on the goal and is
  truncated when the step count reaches ``max_steps`` without terminating (our choice: an episode
  that terminates on its last allowed step is terminated, not truncated).
* A finished episode is absorbing, like gymnasium's transition table: further moves change
  nothing and give reward 0.
* ``info``: ``success`` (player on the goal), ``action_is_valid`` (the text named an action) and
  ``action_is_effective`` (the player's position changed). Text that names no action changes
  nothing, is not counted as a step, and gives reward 0.

Text formats
------------
* Grid (RAGEN's text render): rows joined by newlines, no spaces. ``P`` player, ``_`` ice (the
  start cell renders as ice too), ``O`` hole, ``G`` goal, ``X`` player in a hole, ``√`` player on
  the goal. Example: ``_O__\\nO___\\nG___\\n__P_``.
* Coordinate line (``render_mode="coords"``). SPA's real FrozenLake format is not public
  (UNVERIFIED), so this is our choice, modelled on SPA's Sokoban line: zero-indexed ``(row,col)``,
  no space after the comma, items joined by ``"; "``, a final ``"."``:

  1. ``Player (P) is at (r,c)``, or ``Player in hole (X) is at (r,c)``, or
     ``Player on goal (√) is at (r,c)``;
  2. the holes not under the player, row-major: ``hole (O) is at (r,c)`` for one,
     ``holes (O) are at (r,c), (r,c), ...`` for several, left out when there are none;
  3. ``goal (G) is at (r,c)``, left out when the player stands on it.

  Example: ``Player (P) is at (3,2); holes (O) are at (0,1), (1,0); goal (G) is at (2,0).``

Randomness
----------
All randomness (map and slipping) comes from the ``random.Random(seed)`` given to ``reset``, so a
seed gives the same map and the same slips on every machine and Python version.
"""

from __future__ import annotations

import copy
import random
from typing import ClassVar

from envs.base import EnvError, TextGameEnv

# Gymnasium's action ids: 0 Left, 1 Down, 2 Right, 3 Up, as (row, col) steps.
_MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))

Cell = tuple[int, int]

_BASE_INSTRUCTION = (
    "You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to the "
    "unintended direction due to the slippery ice. Example answer format: <think>To forbid the hole and "
    "go to the target, I should go left then go up.</think><answer>Left || Up</answer>"
)

# "{last}" is the bottom-right coordinate, "3, 3" on the 4x4 board the SPA text was written for.
_WORLD_MODEL_INSTRUCTION = (
    "You are solving the FrozenLake puzzle. You are the player and you need to Forbid the hole and go to "
    "the target. You are provided with a symbol grid and the zero-indexed coordinates of the player, each "
    "hole, and each target. Coordinates range from the top-left corner (0, 0) to the bottom-right corner "
    "({last}). When you are exactly next to goal, you can move in the same direction. You cannot move to "
    "a hole cause you will fall into the hole. The answer should be a sequence of actions, like "
    "<answer>Right || Right || Up</answer>. A sample full output is as follows: <think> <observation>"
    "_O__\nO___\nG___\n__P_</observation> Player (3,2); holes at (0,1) and (1,0); goal at (2,0). "
    "1 Up - move to safe ice (2,2). 2 Left - slide to (2,1), adjacent to goal. 3 Left - reach goal (2,0); "
    "player now on G. <prediction>_O__\nO___\n√___\n____</prediction> </think> "
    "<answer> Up || Left || Left </answer>"
)
# Ours, for the grid without coordinates (SPA without State Estimation): SPA's text without the
# coordinate sentences, the coordinate line of the sample and the positions in its reasoning.
_WORLD_MODEL_INSTRUCTION_WITHOUT_COORDINATES = (
    "You are solving the FrozenLake puzzle. You are the player and you need to Forbid the hole and go to "
    "the target. You are provided with a symbol grid. When you are exactly next to goal, you can move in "
    "the same direction. You cannot move to a hole cause you will fall into the hole. The answer should be "
    "a sequence of actions, like <answer>Right || Right || Up</answer>. A sample full output is as "
    "follows: <think> <observation>_O__\nO___\nG___\n__P_</observation> 1 Up - move to safe ice. 2 Left - "
    "slide next to the goal. 3 Left - reach goal; player now on G. <prediction>_O__\nO___\n√___\n____"
    "</prediction> </think> <answer> Up || Left || Left </answer>"
)


def build_instructions(size: int) -> dict[str, str]:
    """SPA's FrozenLake instruction texts, with the coordinate range fitted to a ``size`` board."""
    last = f"{size - 1}, {size - 1}"
    return {"base": _BASE_INSTRUCTION, "world_model": _WORLD_MODEL_INSTRUCTION.format(last=last)}


#: For render mode "text": no coordinates shown, none promised (the base text never mentions them).
TEXT_INSTRUCTIONS = {"base": _BASE_INSTRUCTION, "world_model": _WORLD_MODEL_INSTRUCTION_WITHOUT_COORDINATES}


def reachable(holes: set[Cell], size: int, start: Cell, goal: Cell) -> bool:
    """Whether ``goal`` can be reached from ``start`` by steps over non-hole cells (a DFS)."""
    seen, stack = {start}, [start]
    while stack:
        row, col = stack.pop()
        if (row, col) == goal:
            return True
        for d_row, d_col in _MOVES:
            nxt = (row + d_row, col + d_col)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in holes and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False


def generate_map(rng: random.Random, size: int, p: float) -> tuple[set[Cell], Cell, Cell]:
    """Draw (holes, start, goal) until the goal is reachable from the start."""
    while True:
        cells = [(row, col) for row in range(size) for col in range(size)]
        holes = {cell for cell in cells if rng.random() >= p}
        start, goal = rng.sample(cells, 2)
        holes -= {start, goal}  # start and goal are never holes
        if reachable(holes, size, start, goal):
            return holes, start, goal


def _join_cells(cells: list[Cell]) -> str:
    return ", ".join(f"({row},{col})" for row, col in cells)


class FrozenLakeEnv(TextGameEnv):
    name: ClassVar[str] = "frozen_lake"
    action_names: ClassVar[tuple[str, ...]] = ("Left", "Down", "Right", "Up")
    legend: ClassVar[dict[str, str]] = {
        "P": "player", "_": "empty", "O": "hole", "G": "goal", "X": "player in hole", "√": "player on goal",
    }
    instructions: ClassVar[dict[str, str]] = build_instructions(4)
    text_instructions: ClassVar[dict[str, str]] = TEXT_INSTRUCTIONS
    max_actions_per_traj: ClassVar[int] = 10
    #: Of the intended (no-slip) step: onto ice, against the edge, into a hole, onto the goal; or
    #: any action once the episode is over.
    action_effects: ClassVar[tuple[str, ...]] = ("move", "edge", "hole", "goal", "over")

    def __init__(self, size: int = 4, p: float = 0.8, is_slippery: bool = True, max_steps: int = 100,
                 render_mode: str = "coords"):
        super().__init__(render_mode=render_mode)
        if size < 2:
            raise EnvError(f"size must be at least 2, got {size}")
        if not 0 < p <= 1:
            raise EnvError(f"p (the chance a cell is ice) must be in (0, 1], got {p}")
        if max_steps < 1:
            raise EnvError(f"max_steps must be at least 1, got {max_steps}")
        self.size, self.p, self.is_slippery, self.max_steps = size, p, is_slippery, max_steps
        # Instance attribute: the world-model text names the bottom-right corner, which depends on size.
        self.instructions = build_instructions(size)
        self.holes: set[Cell] = set()
        self.start = self.goal = self.player = (0, 0)
        self.steps = 0
        self._rng = random.Random(0)

    @classmethod
    def from_grid(cls, text: str, **kwargs) -> FrozenLakeEnv:
        """An env in the position drawn in `text` (`render_grid`'s symbols, a row a line), e.g. to
        replay a shown state's moves. The start renders as ice, so the player's cell stands for it."""
        rows = [line.strip() for line in text.strip().splitlines()]
        cells = {(row, col): symbol for row, line in enumerate(rows) for col, symbol in enumerate(line)}
        players = [cell for cell, symbol in cells.items() if symbol in "PX√"]
        goals = [cell for cell, symbol in cells.items() if symbol in "G√"]
        if any(len(line) != len(rows) for line in rows) or not set(cells.values()) <= set(cls.legend) \
                or len(players) != 1 or len(goals) != 1:
            raise EnvError(f"not a FrozenLake grid (a square of {', '.join(cls.legend)} with one player and "
                           f"one goal): {text!r}")
        env = cls(size=len(rows), **kwargs)
        env.holes = {cell for cell, symbol in cells.items() if symbol in "OX"}
        [env.goal], [env.player] = goals, players
        env.start = env.player
        return env

    # ---- state ---------------------------------------------------------------------------

    def _reset(self, rng: random.Random) -> None:
        self._rng = rng  # kept: the slips of this episode come from the same seed
        self.holes, self.start, self.goal = generate_map(rng, self.size, self.p)
        self.player = self.start
        self.steps = 0

    @property
    def desc(self) -> list[str]:
        """The map in gymnasium's letters (S start, F ice, H hole, G goal), one string per row."""
        def letter(cell: Cell) -> str:
            if cell == self.start:
                return "S"
            return "G" if cell == self.goal else "H" if cell in self.holes else "F"
        return ["".join(letter((row, col)) for col in range(self.size)) for row in range(self.size)]

    def _finished(self, cell: Cell) -> bool:
        return cell == self.goal or cell in self.holes

    # ---- dynamics ------------------------------------------------------------------------

    def _move(self, cell: Cell, action: int) -> Cell:
        """One step in gymnasium direction ``action``; bumping into the edge keeps the player in place."""
        d_row, d_col = _MOVES[action]
        row = min(max(cell[0] + d_row, 0), self.size - 1)
        col = min(max(cell[1] + d_col, 0), self.size - 1)
        return row, col

    def transitions(self, cell: Cell, action: int) -> list[tuple[float, Cell]]:
        """The (probability, next cell) outcomes of ``action`` from ``cell``; ``_step`` samples these.

        Like gymnasium: slipping tries the directions (a-1)%4, a, (a+1)%4 with 1/3 each (a repeated
        cell stays a separate entry), and a finished cell is absorbing.
        """
        if self._finished(cell):
            return [(1.0, cell)]
        if not self.is_slippery:
            return [(1.0, self._move(cell, action))]
        return [(1.0 / 3.0, self._move(cell, (action + turn) % 4)) for turn in (-1, 0, 1)]

    def _action_index(self, action: str) -> int:
        name = self.parse_action(action)
        if name is None:
            raise EnvError(f"not a FrozenLake action: {action!r}")
        return self.action_names.index(name)

    def action_effect(self, action: str) -> str:
        """What the intended (no-slip) step does."""
        index = self._action_index(action)
        if self._finished(self.player):
            return "over"
        cell = self._move(self.player, index)
        if cell == self.player:
            return "edge"
        return "hole" if cell in self.holes else "goal" if cell == self.goal else "move"

    def next_states(self, action: str) -> list[str]:
        index = self._action_index(action)
        intended = self.player if self._finished(self.player) else self._move(self.player, index)
        cells = dict.fromkeys([intended] + [cell for _, cell in self.transitions(self.player, index)])
        trial = copy.copy(self)  # only the player moves, so the map may be shared
        states = []
        for cell in cells:
            trial.player = cell
            states.append(trial.render())
        return states

    def _step(self, action: str) -> tuple[float, bool, bool, dict]:
        name = self.parse_action(action)
        if name is None:  # not understood: nothing happens and no step is used
            return 0.0, *self._status(), self._info(False, False, "not an action")
        was_finished = self._finished(self.player)
        outcomes = self.transitions(self.player, self.action_names.index(name))
        _, new_cell = outcomes[self._rng.randrange(len(outcomes))]  # all outcomes are equally likely
        moved = new_cell != self.player
        self.player = new_cell
        self.steps += 1
        reward = 1.0 if self.player == self.goal and not was_finished else 0.0
        why = "the episode is over" if was_finished else "the edge of the lake is in the way"
        return reward, *self._status(), self._info(True, moved, "" if moved else why)

    def _status(self) -> tuple[bool, bool]:
        """(terminated, truncated): a hole or the goal ends the episode, else running out of steps."""
        terminated = self._finished(self.player)
        return terminated, not terminated and self.steps >= self.max_steps

    def _info(self, valid: bool, effective: bool, no_effect: str = "") -> dict:
        info = {"success": self.player == self.goal, "action_is_valid": valid, "action_is_effective": effective}
        return info | ({"no_effect": no_effect} if no_effect else {})

    # ---- text ----------------------------------------------------------------------------

    def _symbol(self, cell: Cell) -> str:
        if cell == self.player:
            return "X" if cell in self.holes else "√" if cell == self.goal else "P"
        return "O" if cell in self.holes else "G" if cell == self.goal else "_"

    def render_grid(self) -> str:
        return "\n".join(
            "".join(self._symbol((row, col)) for col in range(self.size)) for row in range(self.size)
        )

    def coordinate_line(self) -> str:
        row, col = self.player
        if self.player in self.holes:
            items = [f"Player in hole (X) is at ({row},{col})"]
        elif self.player == self.goal:
            items = [f"Player on goal (√) is at ({row},{col})"]
        else:
            items = [f"Player (P) is at ({row},{col})"]
        holes = sorted(self.holes - {self.player})  # tuples sort row-major
        if len(holes) == 1:
            items.append(f"hole (O) is at {_join_cells(holes)}")
        elif holes:
            items.append(f"holes (O) are at {_join_cells(holes)}")
        if self.player != self.goal:
            items.append(f"goal (G) is at ({self.goal[0]},{self.goal[1]})")
        return "; ".join(items) + "."
