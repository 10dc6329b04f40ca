"""An optimal Sokoban solver: the fewest primitive moves (Up/Down/Left/Right) that solve a room.

Breadth-first search over (player cell, sorted box cells) with gym-sokoban's push rules, so the
first solved state generated is at the minimal number of moves. Moves that change nothing are never
useful and are not generated. Boxes pushed onto a *dead cell* (one from which no push sequence
can bring a box to any target, even with the other boxes gone) are pruned; this keeps the search
small and never removes an optimal solution. Used by the tests and the generator benchmark.
"""

from __future__ import annotations

from collections import deque

from envs.sokoban import ACTIONS, Room, parse_grid

DEFAULT_MAX_STATES = 2_000_000
State = tuple[int, tuple[int, ...]]  # (player cell, sorted box cells)


def live_cells(room: Room) -> set[int]:
    """Cells from which a lone box can be pushed onto some target.

    Found backwards from the targets: a box reaches `cell` with a push in direction `step` when it
    was at `cell - step` and the player stood at `cell - 2 * step`.
    """
    steps = [room.offset(a) for a in range(len(ACTIONS))]
    live = set(room.targets)
    queue = deque(room.targets)
    while queue:
        cell = queue.popleft()
        for step in steps:
            before, stand = cell - step, cell - 2 * step
            if before in live or room.walls[before] or room.walls[stand]:
                continue
            live.add(before)
            queue.append(before)
    return live


def solve(room: Room, max_states: int = DEFAULT_MAX_STATES) -> list[str] | None:
    """A shortest action list that solves `room` ([] if already solved); None if unsolvable.

    Raises RuntimeError if more than `max_states` states would be needed.
    """
    targets = frozenset(room.targets)
    start = (room.player, tuple(sorted(room.boxes)))
    if all(box in targets for box in start[1]):
        return []
    steps = [room.offset(a) for a in range(len(ACTIONS))]
    live = live_cells(room)
    walls = room.walls
    parent: dict[State, tuple[State, int] | None] = {start: None}  # state -> (previous state, action)
    queue = deque([start])
    while queue:
        state = queue.popleft()
        player, boxes = state
        for action, step in enumerate(steps):
            ahead = player + step
            if walls[ahead]:
                continue
            pushes = ahead in boxes
            new_boxes = boxes
            if pushes:
                beyond = ahead + step
                if walls[beyond] or beyond in boxes or beyond not in live:
                    continue
                new_boxes = tuple(sorted(beyond if b == ahead else b for b in boxes))
            new_state = (ahead, new_boxes)
            if new_state in parent:
                continue
            parent[new_state] = (state, action)
            # Only a push can solve; the first solved state generated is at the least depth.
            if pushes and all(box in targets for box in new_boxes):
                return _path(parent, new_state)
            if len(parent) > max_states:
                raise RuntimeError(f"Sokoban solver gave up after {max_states} states")
            queue.append(new_state)
    return None


def _path(parent: dict[State, tuple[State, int] | None], state: State) -> list[str]:
    actions = []
    while parent[state] is not None:
        state, action = parent[state]
        actions.append(ACTIONS[action])
    return actions[::-1]


def solve_grid(text: str, max_states: int = DEFAULT_MAX_STATES) -> list[str] | None:
    """`solve` for a room drawn in the render format."""
    return solve(parse_grid(text), max_states)


def solution_length(room: Room, max_states: int = DEFAULT_MAX_STATES) -> int | None:
    """The fewest moves that solve `room`, or None if it cannot be solved."""
    solution = solve(room, max_states)
    return None if solution is None else len(solution)
