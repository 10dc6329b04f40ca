"""Sokoban as a text game, with a fast reverse-play room generator.

Rules (gym-sokoban's, as inherited by RAGEN and SPA)
----------------------------------------------------
* Actions ``Up``, ``Down``, ``Left``, ``Right`` are gym-sokoban's *push* actions: the player steps
  one cell; stepping into a box pushes it one cell further if that cell is empty floor or an empty
  target. Stepping into a wall, or into a box whose far side is a wall or another box, moves
  nothing (the step still counts and still costs -0.1).
* Rewards per step: -0.1; +1 when a box goes onto a target; -1 when a box leaves a target; +10 when
  all boxes are on targets. Each step's reward is rounded to 10 decimals, so it is exactly -0.1,
  0.9, -1.1 or 10.9 (solving in 5 moves sums to -0.5 + 1 + 10 = 10.5).
* ``terminated`` when every box is on a target; ``truncated`` when ``max_steps`` counted steps
  have been taken without solving (a solve on the last step is terminated, not truncated, so the
  agent loop's "terminated and not truncated" success test holds). Text that is not an action
  changes nothing, is not counted as a step, gives reward 0 and ``action_is_valid=False``.
* ``info``: ``success`` (all boxes on targets), ``action_is_valid``, ``action_is_effective``
  (the player moved).

Formats
-------
Grid: one character per cell, rows joined by ``"\\n"``, no spaces: ``#`` wall, ``_`` empty,
``O`` target, ``√`` box on target, ``X`` box, ``P`` player, ``S`` player on target.

Coordinate line (render mode ``"coords"``, the default; mode ``"text"`` gives the grid alone): the
grid, a newline, then one line of zero-indexed ``(row,col)`` positions (no space after the comma).
With one box and nothing overlapping it is exactly SPA's dataset format::

    Player (P) is at (1,1); box (X) is at (2,2); target (O) is at (2,3).

SPA's format for several boxes or overlaps is not public; ours is: (1) ``Player (P) is at (r,c)``
or ``Player on target (S) is at (r,c)``; (2) boxes off target, ``box (X) is at (r,c)`` or
``boxes (X) are at (r,c), (r,c)``; (3) boxes on target, ``box on target (√) is at ...`` /
``boxes on target (√) are at ...``; (4) targets under neither box nor player, ``target (O) is at
...`` / ``targets (O) are at ...``. Items that would be empty are left out; the rest are joined by
``"; "`` and end with ``"."``; positions within an item are in row-major order.

Room generation (gym-sokoban's recipe, with a faster reverse search)
--------------------------------------------------------------------
1. Topology: a random walk of ``int(1.7 * (dim + dim))`` steps that changes direction with
   probability 0.35 and stamps one of gym-sokoban's five 3x3 floor masks at every step; the
   outer ring is wall.
2. The player and then ``num_boxes`` targets are placed on random floor cells; the boxes start on
   their targets (the solved position).
3. Reverse play: the player walks and *pulls* boxes away from the targets. Every state reached
   this way can be solved by replaying the pulls as pushes, so every room is solvable.
4. Of the states reached with no box on a target, the one with the highest
   ``box_swaps * box_displacement`` wins (displacement: the summed Manhattan distance of each box
   from its own target). A room whose best score is 0 is thrown away and generation starts over.
5. RAGEN's finishing touch: with probability 0.8 (displacement 1) or 0.5 (otherwise) the player
   takes 1 to 3 random steps (each further step with probability 0.5, never revisiting a cell).

What differs from gym-sokoban, and why the rooms stay comparable:

* gym-sokoban searches reverse play by a recursive depth-first search over single player steps
  (ttl 300, up to 300k states), so every player position is its own state; that is where its time
  goes. Here the search is breadth-first over *pull states*: the box positions plus the region the
  player can walk to, computed by a bitmask flood fill. Walking is free inside a region, so one
  pull state stands for all of gym-sokoban's states with the same boxes and region, and every
  reachable box configuration is visited with far fewer states.
* gym-sokoban 0.0.6 hands its recursion the parent's ``last_pull`` instead of the new one, so every
  pull counts as a "swap": ``box_swaps`` is in effect the number of pulls on the depth-first path
  that first reached the state. Here it is the number of pulls on the breadth-first path, i.e. the
  fewest pulls that reach the state. Both scores prefer boxes far from their targets reached by
  many pulls. Measured by ``bench/bench_sokoban_generator.py`` (optimal solution lengths in moves,
  without RAGEN's player steps, which gym-sokoban lacks): 6x6 with 1 box, mean 3.24 / median 2
  here against 3.30 / 2 for gym-sokoban, with nearly the same histogram; 10x10 with 2 boxes,
  17.9 / 18 against 17.6 / 17. The same run made rooms about 35x (6x6) and 90x or more (10x10)
  faster than gym-sokoban.
* The start player position is where the last pull of that path left the player (gym-sokoban's
  first state with the winning boxes usually comes right after a pull); if that cell is a target, the
  player moves to the nearest non-target cell of its region (gym-sokoban scores a state with the
  player on a target 0 and keeps searching).
* ``search_depth`` bounds the number of pulls on a path (gym-sokoban's ttl counts every player
  step); at the default 300 it never binds on these room sizes. The search also stops after
  ``MAX_SEARCH_STATES`` pull states, a guard for large rooms.
* Randomness: only the ``random.Random`` given to ``_reset`` is used (gym-sokoban mixes Python's and
  numpy's global generators), so a seed gives the same room on every machine and Python version.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from typing import ClassVar

from envs.base import EnvError, TextGameEnv

WALL, EMPTY, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = "#", "_", "O", "√", "X", "P", "S"
SYMBOLS = (WALL, EMPTY, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET)
ACTIONS = ("Up", "Down", "Left", "Right")
# (row, col) change of each action, in ACTIONS order.
MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))

P_CHANGE_DIRECTION = 0.35
# gym-sokoban's five floor stamps for the random walk, as (row, col) offsets of their 1-cells
# around the walker (each 3x3 mask has its centre set, which keeps the floor connected).
FLOOR_MASKS = (
    ((0, -1), (0, 0), (0, 1)),
    ((-1, 0), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, -1), (1, 0)),
    ((0, 0), (0, 1), (1, 0)),
)
WALK_DIRECTIONS = ((1, 0), (0, 1), (-1, 0), (0, -1))
MAX_SEARCH_STATES = 20_000
# Attempts (topology + placement + reverse play) before giving up on a room size and box count
# that cannot or can hardly hold a puzzle; at 6x6 about one attempt in seven fails.
MAX_ATTEMPTS = 1000

_BASE_INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets "
    "You are provided with a symbol grid. When you are exactly next to a box, you can push it by moving "
    "in the same direction. You cannot push a box through a wall, and you cannot pull a box. The answer "
    "should be a sequence of actions, like <answer>Right || Right || Up</answer>."
)
# The "–" in the sample output is an en dash (U+2013), as in SPA's envs.yaml.
_WORLD_MODEL_INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets "
    "You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and "
    "each target. Coordinates range from the top-left corner (0, 0) to the bottom-right corner "
    "({last_row}, {last_col}). When you are exactly next to a box, you can push it by moving in the same "
    "direction. You cannot push a box through a wall, and you cannot pull a box. The answer should be a "
    "sequence of actions, like <answer>Right || Right || Up</answer>. A sample full output is as "
    "follows: <think> <observation>######\n#_####\n#_P###\n#_X#_#\n#__O_#\n######\nPlayer (P) is at "
    "(2,2); box (X) is at (3,2); target (O) is at (4,3).</observation> 1 Down \u2013 I push box to (4,2). "
    "2 Left \u2013 I step to (3,1). 3 Down \u2013 I stand left of box, ready to push it Right onto target. "
    "<prediction>######\n#_####\n#__###\n#__#_#\n#PXO_#\n######</prediction> </think> <answer> Down || "
    "Left || Down </answer>"
)


def sokoban_instructions(height: int, width: int) -> dict[str, str]:
    """SPA's two instruction texts; the world-model one names the grid's bottom-right corner."""
    world_model = _WORLD_MODEL_INSTRUCTION.format(last_row=height - 1, last_col=width - 1)
    return {"base": _BASE_INSTRUCTION, "world_model": world_model}


# ---- the room ------------------------------------------------------------------------------


@dataclass
class Room:
    """A Sokoban position. Cells are numbered row-major: cell = row * width + col."""

    height: int
    width: int
    walls: tuple[bool, ...]
    targets: tuple[int, ...]
    boxes: list[int]
    player: int
    target_set: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.target_set = frozenset(self.targets)

    def offset(self, action_index: int) -> int:
        """Cell-number change of one action."""
        dr, dc = MOVES[action_index]
        return dr * self.width + dc

    def solved(self) -> bool:
        return all(box in self.target_set for box in self.boxes)

    def copy(self) -> Room:
        return Room(self.height, self.width, self.walls, self.targets, list(self.boxes), self.player)


def parse_grid(text: str) -> Room:
    """Read a grid in the render format. The outer ring must be wall, so no move leaves the grid."""
    rows = text.strip("\n").split("\n")
    height, width = len(rows), len(rows[0])
    if any(len(row) != width for row in rows):
        raise EnvError("Sokoban grid rows must all have the same length")
    walls, targets, boxes, players = [], [], [], []
    for r, row in enumerate(rows):
        for c, ch in enumerate(row):
            if ch not in SYMBOLS:
                raise EnvError(f"unknown Sokoban symbol {ch!r} at ({r},{c}); symbols: {' '.join(SYMBOLS)}")
            on_border = r in (0, height - 1) or c in (0, width - 1)
            if on_border and ch != WALL:
                raise EnvError(f"the outer ring of a Sokoban grid must be wall; ({r},{c}) is {ch!r}")
            cell = r * width + c
            walls.append(ch == WALL)
            if ch in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET):
                targets.append(cell)
            if ch in (BOX, BOX_ON_TARGET):
                boxes.append(cell)
            if ch in (PLAYER, PLAYER_ON_TARGET):
                players.append(cell)
    if len(players) != 1:
        raise EnvError(f"a Sokoban grid needs exactly one player (P or S), found {len(players)}")
    if not boxes or len(boxes) != len(targets):
        raise EnvError(f"a Sokoban grid needs as many boxes as targets, at least one; "
                       f"found {len(boxes)} boxes and {len(targets)} targets")
    return Room(height, width, tuple(walls), tuple(targets), boxes, players[0])


def grid_text(room: Room) -> str:
    chars = [WALL if wall else EMPTY for wall in room.walls]
    for target in room.targets:
        chars[target] = TARGET
    for box in room.boxes:
        chars[box] = BOX_ON_TARGET if box in room.target_set else BOX
    chars[room.player] = PLAYER_ON_TARGET if room.player in room.target_set else PLAYER
    width = room.width
    return "\n".join("".join(chars[start:start + width]) for start in range(0, len(chars), width))


def coordinate_text(room: Room) -> str:
    def where(cells: list[int]) -> str:
        return ", ".join(f"({cell // room.width},{cell % room.width})" for cell in sorted(cells))

    def item(one: str, many: str, cells: list[int]) -> list[str]:
        if not cells:
            return []
        return [f"{one} is at {where(cells)}" if len(cells) == 1 else f"{many} are at {where(cells)}"]

    player_on_target = room.player in room.target_set
    player = "Player on target (S)" if player_on_target else "Player (P)"
    items = [f"{player} is at {where([room.player])}"]
    items += item("box (X)", "boxes (X)", [b for b in room.boxes if b not in room.target_set])
    items += item("box on target (√)", "boxes on target (√)", [b for b in room.boxes if b in room.target_set])
    covered = set(room.boxes) | {room.player}
    items += item("target (O)", "targets (O)", [t for t in room.targets if t not in covered])
    return "; ".join(items) + "."


# ---- room generation -----------------------------------------------------------------------


@cache
def _walk_tables(dim: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Per room size: each floor mask as a bit pattern whose bit 0 is the stamp's top-left cell; a
    table clamping a row or column index 0..dim into 1..dim-2; the bits of the cells inside the
    outer ring."""
    masks = tuple(sum(1 << ((dr + 1) * dim + dc + 1) for dr, dc in mask) for mask in FLOOR_MASKS)
    clamp = tuple(max(1, min(i, dim - 2)) for i in range(dim + 1))
    inside = sum(1 << (r * dim + c) for r in range(1, dim - 1) for c in range(1, dim - 1))
    return masks, clamp, inside


def random_topology(rng: random.Random, dim: int, num_steps: int) -> int:
    """Floor of a dim x dim room carved by gym-sokoban's random walk, as bits (bit i = cell i).

    Uniform picks are ``int(rng.random() * n)``: as stable across Python versions as
    ``rng.choice`` and several times faster, which matters since this loop is about a third of
    the generator's time.
    """
    masks, clamp, inside = _walk_tables(dim)
    floor_bits = 0
    dr, dc = WALK_DIRECTIONS[int(rng.random() * 4)]
    row, col = rng.randint(1, dim - 1), rng.randint(1, dim - 1)
    for _ in range(num_steps):
        if rng.random() < P_CHANGE_DIRECTION:
            dr, dc = WALK_DIRECTIONS[int(rng.random() * 4)]
        # The walker stays off the outer ring; its stamp may reach the ring, which is walled below.
        row, col = clamp[row + dr], clamp[col + dc]
        floor_bits |= masks[int(rng.random() * 5)] << ((row - 1) * dim + col - 1)
    return floor_bits & inside


def flood(seed_bits: int, free_bits: int, width: int) -> int:
    """Cells reachable from seed_bits through free_bits (bit i = cell i). The wall ring stops any
    wrap-around of the row shifts."""
    reach = seed_bits
    while True:
        grown = (reach | reach << 1 | reach >> 1 | reach << width | reach >> width) & free_bits
        if grown == reach:
            return reach
        reach = grown


def displacement(boxes: tuple[int, ...], targets: tuple[int, ...], width: int) -> int:
    """Summed Manhattan distance of each box from the target it started on."""
    total = 0
    for box, target in zip(boxes, targets):
        total += abs(box // width - target // width) + abs(box % width - target % width)
    return total


def reverse_search(floor_bits: int, width: int, targets: tuple[int, ...], player: int,
                   max_pulls: int, max_states: int = MAX_SEARCH_STATES) -> tuple[tuple[int, ...], int] | None:
    """Breadth-first reverse play from the solved position; the best start as (boxes, player).

    A state is (boxes, player region). Boxes keep their identity (boxes[i] started on
    targets[i]) for the displacement score. Returns None when no reachable state has every box
    off target (score 0).
    """
    target_bits = sum(1 << t for t in targets)
    steps = (-width, width, -1, 1)
    region = flood(1 << player, floor_bits & ~target_bits, width)
    seen: dict[tuple[int, ...], list[int]] = {targets: [region]}
    queue = deque([(targets, target_bits, region, player, 0)])
    best, best_score, expanded = None, 0, 0
    while queue and expanded < max_states:
        boxes, box_bits, region, arrival, pulls = queue.popleft()
        expanded += 1
        # A start needs every box off target and somewhere off target for the player to stand.
        if pulls and not box_bits & target_bits and region & ~target_bits:
            score = pulls * displacement(boxes, targets, width)
            if score > best_score:
                best, best_score = (boxes, region, arrival), score
        if pulls >= max_pulls:
            continue
        free_bits = floor_bits & ~box_bits
        for i, box in enumerate(boxes):
            for step in steps:
                # Pull: the player stands next to the box and steps away, dragging it along.
                stand, dest = box + step, box + 2 * step
                if not (region >> stand & 1 and free_bits >> dest & 1):
                    continue
                new_boxes = boxes[:i] + (stand,) + boxes[i + 1:]
                regions = seen.setdefault(new_boxes, [])
                if any(r >> dest & 1 for r in regions):
                    continue
                new_box_bits = box_bits ^ (1 << box) ^ (1 << stand)
                new_region = flood(1 << dest, floor_bits & ~new_box_bits, width)
                regions.append(new_region)
                queue.append((new_boxes, new_box_bits, new_region, dest, pulls + 1))
    if best is None:
        return None
    boxes, region, arrival = best
    return boxes, nearest_cell(arrival, region, region & ~target_bits, width)


def nearest_cell(start: int, region: int, allowed_bits: int, width: int) -> int:
    """The cell of allowed_bits (non-empty, inside region) nearest to start, walking in region."""
    reach = 1 << start
    while not reach & allowed_bits:
        reach = (reach | reach << 1 | reach >> 1 | reach << width | reach >> width) & region
    hits = reach & allowed_bits
    return (hits & -hits).bit_length() - 1  # lowest-numbered of the nearest cells


def random_player_walk(rng: random.Random, room: Room, start_displacement: int) -> None:
    """RAGEN's finishing touch: a few random player steps, never onto a box or a visited cell."""
    move_probability = 0.8 if start_displacement == 1 else 0.5
    if rng.random() >= move_probability:
        return
    visited = {room.player}
    blocked = set(room.boxes)
    for _ in range(3):
        options = [room.player + room.offset(a) for a in range(4)]
        options = [c for c in options if not room.walls[c] and c not in blocked and c not in visited]
        if not options:
            return
        room.player = rng.choice(options)
        visited.add(room.player)
        if rng.random() >= 0.5:
            return


def generate_room(rng: random.Random, dim: int, num_boxes: int, search_depth: int = 300,
                  player_walk: bool = True) -> Room:
    """A solvable, unsolved dim x dim room with num_boxes boxes (see the module docstring).

    `player_walk=False` leaves out RAGEN's random player steps (gym-sokoban has none), for
    comparing with gym-sokoban's rooms.
    """
    num_steps = int(1.7 * (dim + dim))
    for _ in range(MAX_ATTEMPTS):
        floor_bits = random_topology(rng, dim, num_steps)
        floor_digits = format(floor_bits, f"0{dim * dim}b")[::-1]  # floor_digits[cell] == "1": floor
        cells = [cell for cell, digit in enumerate(floor_digits) if digit == "1"]
        if len(cells) <= num_boxes + 1:
            continue  # too small to hold the player and the boxes with room to move
        player = cells.pop(rng.randrange(len(cells)))
        targets = tuple(cells.pop(rng.randrange(len(cells))) for _ in range(num_boxes))
        found = reverse_search(floor_bits, dim, targets, player, max_pulls=search_depth)
        if found is None:
            continue
        boxes, player = found
        walls = tuple(map("0".__eq__, floor_digits))
        room = Room(dim, dim, walls, tuple(sorted(targets)), list(boxes), player)
        if player_walk:
            random_player_walk(rng, room, displacement(boxes, targets, dim))
        return room
    raise EnvError(f"no solvable {dim}x{dim} Sokoban room with {num_boxes} boxes in {MAX_ATTEMPTS} attempts; "
                   "use fewer boxes or a bigger room")


# ---- the env -------------------------------------------------------------------------------


class SokobanEnv(TextGameEnv):
    """Sokoban with push actions; see the module docstring for rules, formats and generation."""

    name: ClassVar[str] = "sokoban"
    action_names: ClassVar[tuple[str, ...]] = ACTIONS
    legend: ClassVar[dict[str, str]] = {
        "#": "wall", "_": "empty", "O": "target", "√": "box on target", "X": "box", "P": "player",
        "S": "player on target",
    }
    # Per instance: the world-model text names the room's bottom-right corner (5, 5 at 6x6).
    instructions: ClassVar[dict[str, str]] = sokoban_instructions(6, 6)
    max_actions_per_traj: ClassVar[int] = 10

    def __init__(self, dim: int = 6, num_boxes: int = 1, max_steps: int = 100, search_depth: int = 300,
                 render_mode: str = "coords"):
        super().__init__(render_mode=render_mode)
        if dim < 5:  # a pull needs three floor cells in a row inside the wall ring
            raise EnvError(f"Sokoban dim must be at least 5, got {dim}")
        if num_boxes < 1:
            raise EnvError(f"Sokoban num_boxes must be at least 1, got {num_boxes}")
        if max_steps < 1 or search_depth < 1:
            raise EnvError("Sokoban max_steps and search_depth must be positive")
        self.dim, self.num_boxes = dim, num_boxes
        self.max_steps, self.search_depth = max_steps, search_depth
        self.instructions = sokoban_instructions(dim, dim)
        self.room: Room | None = None
        self.num_env_steps = 0

    @classmethod
    def from_grid(cls, text: str, **kwargs) -> SokobanEnv:
        """An env already holding the room drawn in `text` (render format), e.g. for tests.

        `reset()` still generates random rooms; `load_grid` puts a drawn room back.
        """
        room = parse_grid(text)
        kwargs.setdefault("dim", max(5, room.height, room.width))  # the size reset() generates
        kwargs.setdefault("num_boxes", len(room.boxes))
        env = cls(**kwargs)
        env.load_grid(text)
        return env

    def load_grid(self, text: str) -> None:
        """Replace the current room by the one drawn in `text` and restart the step count."""
        self.room = parse_grid(text)
        self.num_env_steps = 0
        self.instructions = sokoban_instructions(self.room.height, self.room.width)

    # ---- TextGameEnv hooks ---------------------------------------------------------------

    def _reset(self, rng: random.Random) -> None:
        self.room = generate_room(rng, self.dim, self.num_boxes, self.search_depth)
        self.num_env_steps = 0
        self.instructions = sokoban_instructions(self.dim, self.dim)

    def _step(self, action: str) -> tuple[float, bool, bool, dict]:
        room = self._require_room()
        name = self.parse_action(action)
        if name is None:
            solved = room.solved()
            truncated = not solved and self.num_env_steps >= self.max_steps
            return 0.0, solved, truncated, self._info(valid=False, effective=False)
        self.num_env_steps += 1
        moved, box_reward = self._move(room, room.offset(ACTIONS.index(name)))
        solved = room.solved()
        reward = -0.1 + box_reward + (10.0 if solved else 0.0)
        truncated = not solved and self.num_env_steps >= self.max_steps
        return round(reward, 10), solved, truncated, self._info(valid=True, effective=moved)

    def render_grid(self) -> str:
        return grid_text(self._require_room())

    def coordinate_line(self) -> str:
        return coordinate_text(self._require_room())

    # ---- helpers -------------------------------------------------------------------------

    @staticmethod
    def _move(room: Room, offset: int) -> tuple[bool, float]:
        """Apply a push action; return (player moved, box-on-target reward change)."""
        ahead = room.player + offset
        if room.walls[ahead]:
            return False, 0.0
        if ahead not in room.boxes:
            room.player = ahead
            return True, 0.0
        beyond = ahead + offset
        if room.walls[beyond] or beyond in room.boxes:
            return False, 0.0
        room.boxes[room.boxes.index(ahead)] = beyond
        room.player = ahead
        return True, float(beyond in room.target_set) - float(ahead in room.target_set)

    def _info(self, valid: bool, effective: bool) -> dict:
        room = self._require_room()
        return {"success": room.solved(), "action_is_valid": valid, "action_is_effective": effective}

    def _require_room(self) -> Room:
        if self.room is None:
            raise EnvError("call reset() (or load_grid()) before using the Sokoban env")
        return self.room
