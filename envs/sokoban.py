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

Instructions
------------
SPA's two texts (``config/envs.yaml``): the world-model one explains the coordinates and shows a
sample output; the released base one (``env_instruction``) mentions neither. The paper's App. A
prints a different base prompt for Sokoban: the released text plus the two sentences that explain
the coordinates. Which of the two produced the paper's numbers is not known; option
``base_instruction`` chooses (``"paper"``, the default, or ``"released"``). The default is the
paper's because the paper prints it as the base prompt of its Sokoban runs, because its PPO and
eval show coordinates, which that prompt explains, and because the released env code never
renders coordinates at all, so the released text was never seen with them in public code.
With render mode ``"text"`` no text promises coordinates (`sokoban_instructions`).

Other vocabularies (SPA's SokobanDifferentGridVocab and SokobanDifferentActionVocab)
------------------------------------------------------------------------------------
``symbols`` maps meanings (``wall``, ``empty``, ``target``, ``box on target``, ``box``, ``player``,
``player on target``) to other characters and ``actions`` maps ``Up``/``Down``/``Left``/``Right``
to other names; unnamed ones keep SPA's. Everything the model reads follows: the grid, the
coordinate line (``Player (A) is at ...``), the legend, the action list, and both instruction texts,
whose example answers and world-model sample output are rendered with the new symbols and names.
A symbol is one character other than whitespace, a digit, ``( ) , | < >`` (see ``FORBIDDEN_SYMBOLS``);
symbols must differ from each other, and action names (compared case-insensitively) too.

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
  many pulls. ``bench/bench_sokoban_generator.py`` compares the two: the histograms of optimal
  solution lengths (without RAGEN's player steps, which gym-sokoban lacks) nearly agree, and the
  rooms come one to two orders of magnitude faster (docs/results.md).
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
from dataclasses import dataclass, field, fields
from functools import cache
from typing import ClassVar

from envs.base import EnvError, TextGameEnv

ACTIONS = ("Up", "Down", "Left", "Right")
# Whitespace is stripped from state lines by the world-model metrics; digits, parentheses and commas
# make up coordinates; a line starting with "|" reads as a Sudoku board; states sit inside
# <observation> tags.
FORBIDDEN_SYMBOLS = frozenset("0123456789(),|<>")
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

# SPA's instruction texts (config/envs.yaml), cut into the pieces they share. Released base prompt:
# HEAD + GRID + RULES; world-model prompt: HEAD + GRID_AND_COORDINATES + RULES + SAMPLE. The typo
# "targets You" is SPA's.
_HEAD = "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets "
_GRID = "You are provided with a symbol grid. "
_GRID_AND_COORDINATES = (
    "You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and "
    "each target. Coordinates range from the top-left corner (0, 0) to the bottom-right corner "
    "({last_row}, {last_col}). "
)
_RULES = (
    "When you are exactly next to a box, you can push it by moving in the same direction. You cannot push "
    "a box through a wall, and you cannot pull a box. The answer should be a sequence of actions, like "
    "<answer>{right} || {right} || {up}</answer>."
)
# The "–" in the sample output is an en dash (U+2013), as in SPA's envs.yaml.
_SAMPLE = (
    " A sample full output is as follows: <think> <observation>{observation}</observation> {steps} "
    "<prediction>{prediction}</prediction> </think> <answer> {down} || {left} || {down} </answer>"
)
_SAMPLE_STEPS = ("1 {down} \u2013 I push box to (4,2). 2 {left} \u2013 I step to (3,1). 3 {down} \u2013 I stand "
                 "left of box, ready to push it {right} onto target.")
# Ours, for the grid without coordinates (SPA without State Estimation): the same steps, no positions.
_SAMPLE_STEPS_WITHOUT_COORDINATES = (
    "1 {down} \u2013 I push box down. 2 {left} \u2013 I step left. 3 {down} \u2013 I stand left of box, ready "
    "to push it {right} onto target."
)
#: The base prompt: "paper" (App. A of the paper: the released text plus the two coordinate
#: sentences of the world-model prompt) or "released" (SPA's config/envs.yaml env_instruction).
BASE_INSTRUCTIONS = ("paper", "released")
# SPA's sample: the room before and after Down, Left, Down, in SPA's symbols.
_SAMPLE_OBSERVATION = "######\n#_####\n#_P###\n#_X#_#\n#__O_#\n######"
_SAMPLE_PREDICTION = "######\n#_####\n#__###\n#__#_#\n#PXO_#\n######"


@dataclass(frozen=True)
class GridSymbols:
    """The character of each kind of cell; the defaults are SPA's."""

    wall: str = "#"
    empty: str = "_"
    target: str = "O"
    box_on_target: str = "√"
    box: str = "X"
    player: str = "P"
    player_on_target: str = "S"

    @classmethod
    def from_option(cls, symbols: dict[str, str] | None) -> GridSymbols:
        """SPA's symbols with some replaced: `symbols` maps meanings ("box on target") to characters."""
        meanings = {meaning: key for key, meaning in _meanings().items()}
        chosen = {}
        for meaning, char in _mapping_option("symbols", symbols).items():
            if meaning not in meanings:
                raise EnvError(f"Sokoban symbols has no meaning {meaning!r}; meanings: {', '.join(meanings)}")
            if not isinstance(char, str) or len(char) != 1 or char.isspace() or char in FORBIDDEN_SYMBOLS:
                raise EnvError(f"Sokoban symbol for {meaning!r} must be one character other than whitespace, "
                               f"a digit or {' '.join(sorted(FORBIDDEN_SYMBOLS - set('0123456789')))}; "
                               f"got {char!r}")
            chosen[meanings[meaning]] = char
        grid_symbols = cls(**chosen)
        if len(set(grid_symbols.legend())) != len(_meanings()):
            raise EnvError(f"Sokoban symbols must all differ, got {' '.join(grid_symbols.legend())}")
        return grid_symbols

    def legend(self) -> dict[str, str]:
        """Symbol -> meaning, in SPA's order (what the prompt shows)."""
        return {getattr(self, key): meaning for key, meaning in _meanings().items()}


def _meanings() -> dict[str, str]:
    """GridSymbols field -> the meaning the legend shows ("box_on_target" -> "box on target")."""
    return {f.name: f.name.replace("_", " ") for f in fields(GridSymbols)}


DEFAULT_SYMBOLS = GridSymbols()


def action_names_from_option(actions: dict[str, str] | None) -> tuple[str, ...]:
    """The four move names in ACTIONS order, with those named in `actions` (e.g. {"Up": "North"}) replaced."""
    renamed = _mapping_option("actions", actions)
    for move in renamed:
        if move not in ACTIONS:
            raise EnvError(f"Sokoban actions has no move {move!r}; moves: {', '.join(ACTIONS)}")
    names = []
    for move in ACTIONS:
        name = renamed.get(move, move)
        if not isinstance(name, str) or not name.strip() or "||" in name or name != name.strip():
            raise EnvError(f"Sokoban action name for {move} must be non-empty text without surrounding "
                           f"spaces or '||', got {name!r}")
        names.append(name)
    if len({name.lower() for name in names}) != len(names):
        raise EnvError(f"Sokoban action names must differ (ignoring case), got {', '.join(names)}")
    return tuple(names)


def _mapping_option(option: str, value: dict[str, str] | None) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise EnvError(f"Sokoban {option} must be a mapping, got {value!r}")
    return value


def sokoban_instructions(height: int, width: int, symbols: GridSymbols = DEFAULT_SYMBOLS,
                         action_names: tuple[str, ...] = ACTIONS, coordinates: bool = True,
                         base: str = "paper") -> dict[str, str]:
    """The instruction texts of both prompt modes for a room of this size, in this vocabulary.

    With `coordinates` (render mode "coords"): the world-model text is SPA's, naming the room's
    bottom-right corner, and the base text is the `base` variant: "paper", the base prompt of the
    paper's App. A (the released text plus the sentences that explain the coordinates), or
    "released", SPA's env_instruction, which does not mention them. Without coordinates (render
    mode "text") no text promises coordinates: the base text is the released one (the paper's
    coordinate sentences would describe a line that is not shown), and the world-model text
    drops the coordinate sentences, the coordinate line of its sample observation and the
    positions in its sample reasoning. The example answers use `action_names`; the sample output
    is rendered in `symbols`.
    """
    if base not in BASE_INSTRUCTIONS:
        raise EnvError(f"Sokoban base_instruction must be one of {', '.join(BASE_INSTRUCTIONS)}, got {base!r}")
    base_text, world_model = _instruction_texts(height, width, symbols, action_names, coordinates,
                                                base == "paper")
    return {"base": base_text, "world_model": world_model}


@cache  # every reset asks again; rendering the sample would be a quarter of a 6x6 reset's time
def _instruction_texts(height: int, width: int, symbols: GridSymbols, action_names: tuple[str, ...],
                       coordinates: bool, paper_base: bool) -> tuple[str, str]:
    names = dict(zip(("up", "down", "left", "right"), action_names))
    before, after = parse_grid(_SAMPLE_OBSERVATION), parse_grid(_SAMPLE_PREDICTION)
    grid = _GRID_AND_COORDINATES.format(last_row=height - 1, last_col=width - 1) if coordinates else _GRID
    observation = grid_text(before, symbols)
    if coordinates:
        observation += f"\n{coordinate_text(before, symbols)}"
    steps = (_SAMPLE_STEPS if coordinates else _SAMPLE_STEPS_WITHOUT_COORDINATES).format(**names)
    rules = _RULES.format(**names)
    sample = _SAMPLE.format(observation=observation, steps=steps, prediction=grid_text(after, symbols), **names)
    base = _HEAD + (grid if paper_base else _GRID) + rules
    return base, _HEAD + grid + rules + sample


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


def parse_grid(text: str, symbols: GridSymbols = DEFAULT_SYMBOLS) -> Room:
    """Read a grid in the render format. The outer ring must be wall, so no move leaves the grid."""
    rows = text.strip("\n").split("\n")
    height, width = len(rows), len(rows[0])
    if any(len(row) != width for row in rows):
        raise EnvError("Sokoban grid rows must all have the same length")
    known = symbols.legend()
    walls, targets, boxes, players = [], [], [], []
    for r, row in enumerate(rows):
        for c, ch in enumerate(row):
            if ch not in known:
                raise EnvError(f"unknown Sokoban symbol {ch!r} at ({r},{c}); symbols: {' '.join(known)}")
            on_border = r in (0, height - 1) or c in (0, width - 1)
            if on_border and ch != symbols.wall:
                raise EnvError(f"the outer ring of a Sokoban grid must be wall; ({r},{c}) is {ch!r}")
            cell = r * width + c
            walls.append(ch == symbols.wall)
            if ch in (symbols.target, symbols.box_on_target, symbols.player_on_target):
                targets.append(cell)
            if ch in (symbols.box, symbols.box_on_target):
                boxes.append(cell)
            if ch in (symbols.player, symbols.player_on_target):
                players.append(cell)
    if len(players) != 1:
        raise EnvError(f"a Sokoban grid needs exactly one player ({symbols.player} or "
                       f"{symbols.player_on_target}), found {len(players)}")
    if not boxes or len(boxes) != len(targets):
        raise EnvError(f"a Sokoban grid needs as many boxes as targets, at least one; "
                       f"found {len(boxes)} boxes and {len(targets)} targets")
    return Room(height, width, tuple(walls), tuple(targets), boxes, players[0])


def grid_text(room: Room, symbols: GridSymbols = DEFAULT_SYMBOLS) -> str:
    chars = [symbols.wall if wall else symbols.empty for wall in room.walls]
    for target in room.targets:
        chars[target] = symbols.target
    for box in room.boxes:
        chars[box] = symbols.box_on_target if box in room.target_set else symbols.box
    chars[room.player] = symbols.player_on_target if room.player in room.target_set else symbols.player
    width = room.width
    return "\n".join("".join(chars[start:start + width]) for start in range(0, len(chars), width))


def coordinate_text(room: Room, symbols: GridSymbols = DEFAULT_SYMBOLS) -> str:
    def where(cells: list[int]) -> str:
        return ", ".join(f"({cell // room.width},{cell % room.width})" for cell in sorted(cells))

    def item(one: str, many: str, symbol: str, cells: list[int]) -> list[str]:
        if not cells:
            return []
        if len(cells) == 1:
            return [f"{one} ({symbol}) is at {where(cells)}"]
        return [f"{many} ({symbol}) are at {where(cells)}"]

    s = symbols
    player_on_target = room.player in room.target_set
    player = f"Player on target ({s.player_on_target})" if player_on_target else f"Player ({s.player})"
    items = [f"{player} is at {where([room.player])}"]
    items += item("box", "boxes", s.box, [b for b in room.boxes if b not in room.target_set])
    items += item("box on target", "boxes on target", s.box_on_target,
                  [b for b in room.boxes if b in room.target_set])
    covered = set(room.boxes) | {room.player}
    items += item("target", "targets", s.target, [t for t in room.targets if t not in covered])
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
    # The class attributes are SPA's vocabulary; an instance built with `symbols` or `actions`
    # carries its own legend, action names and instructions.
    action_names: ClassVar[tuple[str, ...]] = ACTIONS
    legend: ClassVar[dict[str, str]] = DEFAULT_SYMBOLS.legend()
    # Per instance: the world-model text names the room's bottom-right corner (5, 5 at 6x6).
    instructions: ClassVar[dict[str, str]] = sokoban_instructions(6, 6)
    text_instructions: ClassVar[dict[str, str]] = sokoban_instructions(6, 6, coordinates=False)
    max_actions_per_traj: ClassVar[int] = 10
    #: A free step, a step into a wall, a box pushed, a box that cannot move (wall or box behind it).
    action_effects: ClassVar[tuple[str, ...]] = ("move", "wall", "push", "push_blocked")

    def __init__(self, dim: int = 6, num_boxes: int = 1, max_steps: int = 100, search_depth: int = 300,
                 render_mode: str = "coords", symbols: dict[str, str] | None = None,
                 actions: dict[str, str] | None = None, base_instruction: str = "paper"):
        super().__init__(render_mode=render_mode)
        if base_instruction not in BASE_INSTRUCTIONS:
            raise EnvError(f"Sokoban base_instruction must be one of {', '.join(BASE_INSTRUCTIONS)}, "
                           f"got {base_instruction!r}")
        self.base_instruction = base_instruction
        if dim < 5:  # a pull needs three floor cells in a row inside the wall ring
            raise EnvError(f"Sokoban dim must be at least 5, got {dim}")
        if num_boxes < 1:
            raise EnvError(f"Sokoban num_boxes must be at least 1, got {num_boxes}")
        if max_steps < 1 or search_depth < 1:
            raise EnvError("Sokoban max_steps and search_depth must be positive")
        self.dim, self.num_boxes = dim, num_boxes
        self.max_steps, self.search_depth = max_steps, search_depth
        self.symbols = GridSymbols.from_option(symbols)
        self.action_names = action_names_from_option(actions)
        self.legend = self.symbols.legend()
        self._describe(dim, dim)
        self.room: Room | None = None
        self.num_env_steps = 0

    @classmethod
    def from_grid(cls, text: str, **kwargs) -> SokobanEnv:
        """An env already holding the room drawn in `text` (render format, in the `symbols` given
        among `kwargs`, if any), e.g. for tests.

        `reset()` still generates random rooms; `load_grid` puts a drawn room back.
        """
        room = parse_grid(text, GridSymbols.from_option(kwargs.get("symbols")))
        kwargs.setdefault("dim", max(5, room.height, room.width))  # the size reset() generates
        kwargs.setdefault("num_boxes", len(room.boxes))
        env = cls(**kwargs)
        env.load_grid(text)
        return env

    def load_grid(self, text: str) -> None:
        """Replace the current room by the one drawn in `text` and restart the step count."""
        self.room = parse_grid(text, self.symbols)
        self.num_env_steps = 0
        self._describe(self.room.height, self.room.width)

    def _describe(self, height: int, width: int) -> None:
        """The instruction texts for a room of this size in this env's vocabulary, per render mode."""
        self.instructions = sokoban_instructions(height, width, self.symbols, self.action_names,
                                                 base=self.base_instruction)
        self.text_instructions = sokoban_instructions(height, width, self.symbols, self.action_names,
                                                      coordinates=False)

    # ---- TextGameEnv hooks ---------------------------------------------------------------

    def _reset(self, rng: random.Random) -> None:
        self.room = generate_room(rng, self.dim, self.num_boxes, self.search_depth)
        self.num_env_steps = 0
        self._describe(self.dim, self.dim)

    def _step(self, action: str) -> tuple[float, bool, bool, dict]:
        room = self._require_room()
        name = self.parse_action(action)
        if name is None:
            solved = room.solved()
            truncated = not solved and self.num_env_steps >= self.max_steps
            return 0.0, solved, truncated, self._info(valid=False, effective=False, no_effect="not an action")
        self.num_env_steps += 1
        offset = room.offset(self.action_names.index(name))
        blocked = "a wall is in the way" if room.walls[room.player + offset] else "the box cannot move that way"
        moved, box_reward = self._move(room, offset)
        solved = room.solved()
        reward = -0.1 + box_reward + (10.0 if solved else 0.0)
        truncated = not solved and self.num_env_steps >= self.max_steps
        return round(reward, 10), solved, truncated, self._info(valid=True, effective=moved,
                                                                no_effect="" if moved else blocked)

    def render_grid(self) -> str:
        return grid_text(self._require_room(), self.symbols)

    def coordinate_line(self) -> str:
        return coordinate_text(self._require_room(), self.symbols)

    def action_effect(self, action: str) -> str:
        room = self._require_room()
        name = self.parse_action(action)
        if name is None:
            raise EnvError(f"not a Sokoban action: {action!r}")
        offset = room.offset(self.action_names.index(name))
        ahead = room.player + offset
        if room.walls[ahead]:
            return "wall"
        if ahead not in room.boxes:
            return "move"
        beyond = ahead + offset
        return "push_blocked" if room.walls[beyond] or beyond in room.boxes else "push"

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

    def _info(self, valid: bool, effective: bool, no_effect: str = "") -> dict:
        room = self._require_room()
        info = {"success": room.solved(), "action_is_valid": valid, "action_is_effective": effective}
        return info | ({"no_effect": no_effect} if no_effect else {})

    def _require_room(self) -> Room:
        if self.room is None:
            raise EnvError("call reset() (or load_grid()) before using the Sokoban env")
        return self.room
