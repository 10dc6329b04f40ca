"""Sokoban room generator: speed and difficulty against gym-sokoban 0.0.6's.

For 6x6 rooms with 1 box and 10x10 rooms with 2 boxes this generates N rooms with each generator,
times them (rooms per second of wall-clock and of CPU time), solves every room optimally with
`envs.sokoban_solver` and prints the distribution of optimal solution lengths (moves) as one JSON
object on stdout (progress goes to stderr).

* ours: `SokobanEnv(dim, num_boxes).reset(seed=i)` for i in 0..N-1, what SPA training sees
  (it includes RAGEN's random player steps after reverse play). This takes well under a second,
  so one busy moment of the machine would skew it: it is timed 3 times and the median pass is
  reported (gym-sokoban's single pass lasts long enough to average such moments out).
* ours_no_player_walk: the same seeds without those steps, the like-for-like difficulty
  comparison with gym-sokoban (which has none); not timed.
* gym_sokoban: `room_utils.generate_room(dim=(d, d), num_boxes=b, num_steps=int(1.7 * 2d),
  second_player=False)` after `random.seed(i)` and `np.random.seed(i)`. When it raises (too few
  floor cells, or score 0 after its 4 tries) it is called again without reseeding, as
  gym-sokoban's own `reset` does; the time of failed calls counts.

gym-sokoban's package `__init__` imports `gym`, so `room_utils.py` (numpy only) is loaded by file
path. Install it with `pip install -e '.[bench]'` or `pip install --no-deps gym-sokoban==0.0.6`.

Usage: python bench/bench_sokoban_generator.py [--n6 2000] [--n10 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from envs.sokoban import Room, SokobanEnv, generate_room
from envs.sokoban_solver import solution_length

# gym-sokoban's cell codes after generation.
GYM_WALL, GYM_TARGET, GYM_BOXES, GYM_PLAYER = 0, 2, (3, 4), 5


def load_gym_room_utils():
    spec = importlib.util.find_spec("gym_sokoban")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        sys.exit("gym-sokoban is not installed; install the bench extra (pip install -e '.[bench]') "
                 "or run: pip install --no-deps gym-sokoban==0.0.6")
    path = Path(spec.submodule_search_locations[0]) / "envs" / "room_utils.py"
    module_spec = importlib.util.spec_from_file_location("gym_sokoban_room_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def gym_room(room_utils, seed: int, dim: int, num_boxes: int) -> tuple[Room, int]:
    """One gym-sokoban room as our Room, and the number of failed generator calls before it."""
    random.seed(seed)
    np.random.seed(seed)
    failures = 0
    while True:
        try:
            structure, state, _ = room_utils.generate_room(dim=(dim, dim), num_boxes=num_boxes,
                                                           num_steps=int(1.7 * (dim + dim)),
                                                           second_player=False)
            break
        except (RuntimeError, RuntimeWarning):
            failures += 1
    fixed, cells = structure.flatten().tolist(), state.flatten().tolist()
    room = Room(dim, dim, tuple(v == GYM_WALL for v in fixed),
                tuple(i for i, v in enumerate(fixed) if v == GYM_TARGET),
                [i for i, v in enumerate(cells) if v in GYM_BOXES], cells.index(GYM_PLAYER))
    return room, failures


def timed(make_rooms, repeats: int = 1) -> tuple[list, dict]:
    """The rooms of the last pass and the median pass's wall-clock and CPU times."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        rooms = make_rooms()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    return rooms, {"seconds": round(wall, 3), "rooms_per_s": round(len(rooms) / wall, 1),
                   "rooms_per_cpu_s": round(len(rooms) / cpu, 1), "passes": repeats}


def length_stats(rooms: list[Room]) -> dict:
    lengths = [solution_length(room) for room in rooms]
    solvable = [n for n in lengths if n is not None]
    p10, p25, p75, p90 = (float(x) for x in np.percentile(solvable, [10, 25, 75, 90]))
    histogram = {str(n): solvable.count(n) for n in sorted(set(solvable))}
    return {"solvable": len(solvable), "already_solved": solvable.count(0),
            "mean": round(statistics.mean(solvable), 3), "median": statistics.median(solvable),
            "p10": p10, "p25": p25, "p75": p75, "p90": p90, "min": min(solvable), "max": max(solvable),
            "histogram": histogram}


def bench_size(room_utils, dim: int, num_boxes: int, n: int) -> dict:
    print(f"{dim}x{dim}, {num_boxes} box(es), {n} rooms per generator", file=sys.stderr, flush=True)
    env = SokobanEnv(dim=dim, num_boxes=num_boxes)

    def ours() -> list[Room]:
        rooms = []
        for seed in range(n):
            env.reset(seed=seed)
            rooms.append(env.room.copy())
        return rooms

    def theirs() -> list[tuple[Room, int]]:
        return [gym_room(room_utils, seed, dim, num_boxes) for seed in range(n)]

    our_rooms, our_time = timed(ours, repeats=3)
    gym_results, gym_time = timed(theirs)
    gym_rooms = [room for room, _ in gym_results]
    gym_time["failed_calls"] = sum(failures for _, failures in gym_results)
    no_walk = [generate_room(random.Random(seed), dim, num_boxes, player_walk=False) for seed in range(n)]
    print("  generated; solving", file=sys.stderr, flush=True)
    return {
        "n": n,
        "speedup_rooms_per_s": round(our_time["rooms_per_s"] / gym_time["rooms_per_s"], 1),
        "speedup_rooms_per_cpu_s": round(our_time["rooms_per_cpu_s"] / gym_time["rooms_per_cpu_s"], 1),
        "ours": {**our_time, "solution_length": length_stats(our_rooms)},
        "ours_no_player_walk": {"solution_length": length_stats(no_walk)},
        "gym_sokoban": {**gym_time, "solution_length": length_stats(gym_rooms)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n6", type=int, default=2000, help="rooms per generator at 6x6, 1 box")
    parser.add_argument("--n10", type=int, default=200, help="rooms per generator at 10x10, 2 boxes")
    args = parser.parse_args()
    room_utils = load_gym_room_utils()
    result = {
        "benchmark": "sokoban_generator",
        "gym_sokoban_version": "0.0.6",
        "solution_length_unit": "primitive moves of an optimal solution (BFS)",
        "6x6_1box": bench_size(room_utils, 6, 1, args.n6),
        "10x10_2boxes": bench_size(room_utils, 10, 2, args.n10),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
