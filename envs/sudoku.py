"""4x4 Sudoku as a text game, following the SPA author's Sudoku env (RAGEN pull request 147).

Puzzle
------
* A full solution is built from the base pattern ``((r*2 + r//2 + c) % 4) + 1``, then the bands and
  the rows inside each band are shuffled, the stacks and the columns inside each stack are
  shuffled, and the digits 1..4 are permuted.
* Holes are dug by visiting the cells in a shuffled order and blanking a cell only if the puzzle
  keeps exactly one solution (a backtracking counter that stops at 2), until the clue count
  reaches the target. Up to 8 extra passes follow, as in the reference; since blanking more cells
  can only add solutions, a cell rejected once stays rejected, so we stop at the first pass that
  blanks nothing.
* Clue targets: ``easy`` 10 (6 blanks, the paper's "six empty cells"), ``medium`` 9, ``hard`` 6;
  ``blanks=k`` overrides the target with ``16 - k`` clues. When no unique-solution puzzle with that
  few clues is found, the closest one reached (the fewest clues) is kept.
* All randomness comes from the ``random.Random(seed)`` given to ``reset``.

Moves
-----
* A move is ``"r,c,v"``, ``"r c v"`` or ``"place V at row R col C"`` (1-indexed, case and spacing
  free). ``parse_action`` returns the canonical ``"r,c,v"`` for any such text, whatever the numbers;
  range checks happen in ``step`` (so an out-of-range move counts as a parsed but invalid move).
* Every step counts, invalid ones too.
* Not understood, a row/column outside 1..4, a value outside 1..4, or a cell that is an initial
  clue: nothing changes, reward 0, ``action_is_valid`` False, ``action_is_effective`` False.
* A value that repeats in the cell's row, column or 2x2 box: nothing changes, reward 0,
  ``action_is_valid`` True, ``action_is_effective`` False.
* Otherwise the value is written, and ``action_is_effective`` is True (also when it rewrites the
  same value, as in the reference). Cells the player filled may be rewritten.
* Reward 1.0 only when the board is complete and equals the solution, which terminates the
  episode; 0 otherwise. Truncated when the step count reaches ``max_steps`` without solving.
  A solved episode is absorbing: further moves change nothing and give reward 0.

Text formats
------------
* Board, one line: each row is ``"| "`` followed by its cells, each cell followed by a space, ``.``
  for an empty cell: ``| . 1 2 4 | 4 2 1 3 | 2 3 4 1 | . 4 . 2 `` (note the trailing space).
* Coordinate line (``render_mode="coords"``), 1-indexed (row,col) in row-major order:
  ``Empty positions to be filled are at (1,1), (4,1), (4,3).``,
  ``Empty position to be filled is at (r,c).`` or
  ``No empty positions found (board might be complete).``
"""

from __future__ import annotations

import random
import re
from typing import ClassVar

from envs.base import EnvError, TextGameEnv

BOX = 2  # side of a box
N = BOX * BOX  # side of the board and the largest digit
CLUE_TARGETS = {"easy": 10, "medium": 9, "hard": 6}
EXTRA_PASSES = 8

Board = list[list[int]]  # 0 marks an empty cell

_ACTION_PATTERNS = [
    re.compile(r"(\d+)\s*,\s*(\d+)\s*,\s*(\d+)"),
    re.compile(r"(\d+)\s+(\d+)\s+(\d+)"),
]
# "place V at row R col C": the value comes first, so its groups are reordered below.
_PLACE_PATTERN = re.compile(r"place\s+(\d+)\s+at\s+row\s+(\d+)\s+col\s+(\d+)", re.IGNORECASE)

_SHARED_INSTRUCTION = (
    "You are solving 4x4 Sudoku. Fill empty cells with digits 1–4. Use a 1-indexed grid (rows/cols start "
    "at 1). A move is exactly: row,col,value (three integers). In one turn you may output multiple moves, "
    "separated by ||. Only propose moves that keep the row, column, and 2x2 subgrid valid. Always output "
    "EXACTLY: <think>[brief reasoning]</think> <answer>[r,c,v || r,c,v ...]</answer> No extra text "
    "outside the two tags."
)
INSTRUCTIONS = {
    "base": _SHARED_INSTRUCTION + " Keep the response under 50 words. Example: <think>Row 1 has one empty "
    "cell → place 1. Column 2 then needs 2.</think> <answer>1,3,1 || 3,2,2</answer>",
    "world_model": _SHARED_INSTRUCTION + " Keep the response under 100 words. An example output: <think> "
    "<observation>| . . 1 4 | 1 4 . 3 | 4 2 . . | . 1 4 2 \nEmpty positions to be filled are at (1,1), "
    "(1,2), (2,3), (3,3), (3,4), (4,1)</observation> <prediction>| 2 3 1 4 | 1 4 2 3 | 4 2 3 1 | . 1 4 2\n "
    "Empty positions to be filled are at (4,1)</prediction> </think> <answer> 1,1,2 || 1,2,3 || 2,3,2 || "
    "3,3,3 || 3,4,1 </answer>.",
}
#: For render mode "text" (ours): the sample states without their "Empty positions" lines.
TEXT_INSTRUCTIONS = {
    "base": INSTRUCTIONS["base"],
    "world_model": _SHARED_INSTRUCTION + " Keep the response under 100 words. An example output: <think> "
    "<observation>| . . 1 4 | 1 4 . 3 | 4 2 . . | . 1 4 2 </observation> <prediction>| 2 3 1 4 | 1 4 2 3 | "
    "4 2 3 1 | . 1 4 2</prediction> </think> <answer> 1,1,2 || 1,2,3 || 2,3,2 || 3,3,3 || 3,4,1 </answer>.",
}


# ---- rules -------------------------------------------------------------------------------

def conflicts(board: Board, row: int, col: int, value: int) -> bool:
    """Whether ``value`` already appears in the row, column or box of (row, col), that cell aside."""
    top, left = row - row % BOX, col - col % BOX
    peers = {(row, c) for c in range(N)} | {(r, col) for r in range(N)}
    peers |= {(r, c) for r in range(top, top + BOX) for c in range(left, left + BOX)}
    peers.discard((row, col))
    return any(board[r][c] == value for r, c in peers)


def conflict_units(board: Board, row: int, col: int, value: int) -> list[str]:
    """Where ``value`` already appears among the peers of (row, col): "row", "column", "box"."""
    top, left = row - row % BOX, col - col % BOX
    units = {"row": [(row, c) for c in range(N)], "column": [(r, col) for r in range(N)],
             "box": [(r, c) for r in range(top, top + BOX) for c in range(left, left + BOX)]}
    return [name for name, cells in units.items()
            if any(board[r][c] == value for r, c in cells if (r, c) != (row, col))]


def count_solutions(board: Board, limit: int = 2) -> int:
    """Number of completions of ``board``, counting no further than ``limit`` (backtracking)."""
    empty = next(((r, c) for r in range(N) for c in range(N) if board[r][c] == 0), None)
    if empty is None:
        return 1
    row, col = empty
    found = 0
    for value in range(1, N + 1):
        if not conflicts(board, row, col, value):
            board[row][col] = value
            found += count_solutions(board, limit - found)
            board[row][col] = 0
            if found >= limit:
                break
    return found


# ---- generation --------------------------------------------------------------------------

def _shuffled_lines(rng: random.Random) -> list[int]:
    """A row (or column) order that keeps bands (stacks) intact: shuffle the bands, then inside each."""
    bands = list(range(BOX))
    rng.shuffle(bands)
    order = []
    for band in bands:
        lines = [band * BOX + i for i in range(BOX)]
        rng.shuffle(lines)
        order += lines
    return order


def generate_solution(rng: random.Random) -> Board:
    """A random full grid: the base pattern with shuffled rows, columns and digits."""
    rows, cols = _shuffled_lines(rng), _shuffled_lines(rng)
    digits = list(range(1, N + 1))
    rng.shuffle(digits)

    def base(r: int, c: int) -> int:
        return (r * BOX + r // BOX + c) % N + 1

    return [[digits[base(r, c) - 1] for c in cols] for r in rows]


def dig_holes(rng: random.Random, solution: Board, target_clues: int) -> Board:
    """Blank cells while the puzzle keeps a unique solution, until at most ``target_clues`` remain."""
    puzzle = [row[:] for row in solution]
    clues = N * N
    for _ in range(1 + EXTRA_PASSES):
        cells = [(r, c) for r in range(N) for c in range(N) if puzzle[r][c]]
        rng.shuffle(cells)
        blanked = 0
        for r, c in cells:
            if clues <= target_clues:
                return puzzle
            value, puzzle[r][c] = puzzle[r][c], 0
            if count_solutions(puzzle) == 1:
                clues, blanked = clues - 1, blanked + 1
            else:
                puzzle[r][c] = value
        if clues <= target_clues or not blanked:  # a further pass could blank nothing new
            break
    return puzzle


# ---- the game ----------------------------------------------------------------------------

class SudokuEnv(TextGameEnv):
    name: ClassVar[str] = "sudoku"
    action_names: ClassVar[None] = None
    move_format: ClassVar[str] = "r,c,v (1-indexed)"
    legend: ClassVar[None] = None
    instructions: ClassVar[dict[str, str]] = INSTRUCTIONS
    text_instructions: ClassVar[dict[str, str]] = TEXT_INSTRUCTIONS
    max_actions_per_traj: ClassVar[int] = 50
    #: A value written into a non-clue cell, a value its row, column or box already has (no
    #: change), a move that is not allowed at all (a clue, out of range, the puzzle solved).
    action_effects: ClassVar[tuple[str, ...]] = ("fill", "conflict", "invalid")

    def __init__(self, difficulty: str = "easy", max_steps: int = 30, render_mode: str = "coords",
                 blanks: int | None = None):
        super().__init__(render_mode=render_mode)
        if difficulty not in CLUE_TARGETS:
            raise EnvError(f"difficulty must be one of {', '.join(CLUE_TARGETS)}, got {difficulty!r}")
        if blanks is not None and not 0 <= blanks <= N * N:
            raise EnvError(f"blanks must be between 0 and {N * N}, got {blanks}")
        if max_steps < 1:
            raise EnvError(f"max_steps must be at least 1, got {max_steps}")
        self.difficulty, self.max_steps, self.blanks = difficulty, max_steps, blanks
        self.target_clues = CLUE_TARGETS[difficulty] if blanks is None else N * N - blanks
        self.solution: Board = [[0] * N for _ in range(N)]
        self.puzzle: Board = [[0] * N for _ in range(N)]
        self.board: Board = [[0] * N for _ in range(N)]
        self.steps = 0

    def _reset(self, rng: random.Random) -> None:
        self.solution = generate_solution(rng)
        self.puzzle = dig_holes(rng, self.solution, self.target_clues)
        self.board = [row[:] for row in self.puzzle]
        self.steps = 0

    @property
    def solved(self) -> bool:
        return self.board == self.solution

    # ---- actions -------------------------------------------------------------------------

    def parse_action(self, text: str) -> str | None:
        text = text.strip()
        for pattern in _ACTION_PATTERNS:
            match = pattern.fullmatch(text)
            if match:
                row, col, value = (int(g) for g in match.groups())
                return f"{row},{col},{value}"
        match = _PLACE_PATTERN.fullmatch(text)
        if match:
            value, row, col = (int(g) for g in match.groups())
            return f"{row},{col},{value}"
        return None

    def sample_action(self, rng: random.Random) -> str:
        row, col, value = (rng.randint(1, N) for _ in range(3))
        return f"{row},{col},{value}"

    def probe_actions(self) -> list[str]:
        """Every value in every empty cell."""
        return [f"{r + 1},{c + 1},{v}" for r in range(N) for c in range(N) if not self.board[r][c]
                for v in range(1, N + 1)]

    def action_effect(self, action: str) -> str:
        move, _ = self._checked_move(action)
        if move is None or self.solved:
            return "invalid"
        return "conflict" if conflicts(self.board, *move) else "fill"

    def _step(self, action: str) -> tuple[float, bool, bool, dict]:
        self.steps += 1  # every step counts, invalid ones too
        move, problem = self._checked_move(action)
        if self.solved:  # absorbing once solved: nothing changes and there is no second reward
            return 0.0, *self._status(), self._info(move is not None, False, "the puzzle is already solved")
        if move is None:
            return 0.0, *self._status(), self._info(False, False, problem)
        row, col, value = move
        if conflicts(self.board, row, col, value):
            where = " and ".join(conflict_units(self.board, row, col, value))
            return 0.0, *self._status(), self._info(True, False, f"{value} is already in the {where} of "
                                                                  f"({row + 1},{col + 1})")
        self.board[row][col] = value
        reward = 1.0 if self.solved else 0.0
        return reward, *self._status(), self._info(True, True)

    def _checked_move(self, action: str) -> tuple[tuple[int, int, int] | None, str]:
        """Zero-indexed (row, col, value) of a well-formed, in-range move on a non-clue cell, or
        None and why not."""
        canonical = self.parse_action(action)
        if canonical is None:
            return None, "not a move (r,c,v)"
        row, col, value = (int(x) for x in canonical.split(","))
        if not (1 <= row <= N and 1 <= col <= N and 1 <= value <= N):
            return None, f"row, column and value must be 1 to {N}"
        if self.puzzle[row - 1][col - 1]:  # initial clues are fixed
            return None, f"({row},{col}) is a clue"
        return (row - 1, col - 1, value), ""

    def _status(self) -> tuple[bool, bool]:
        """(terminated, truncated): solving ends the episode, else running out of steps."""
        terminated = self.solved
        return terminated, not terminated and self.steps >= self.max_steps

    def _info(self, valid: bool, effective: bool, no_effect: str = "") -> dict:
        info = {"success": self.solved, "action_is_valid": valid, "action_is_effective": effective}
        return info | ({"no_effect": no_effect} if no_effect else {})

    # ---- text ----------------------------------------------------------------------------

    def render_grid(self) -> str:
        return "".join("| " + "".join(f"{v if v else '.'} " for v in row) for row in self.board)

    def coordinate_line(self) -> str:
        empty = [f"({r + 1},{c + 1})" for r in range(N) for c in range(N) if not self.board[r][c]]
        if not empty:
            return "No empty positions found (board might be complete)."
        if len(empty) == 1:
            return f"Empty position to be filled is at {empty[0]}."
        return f"Empty positions to be filled are at {', '.join(empty)}."
