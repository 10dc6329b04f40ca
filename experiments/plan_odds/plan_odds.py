"""How good were the plans? FrozenLake's slippery ice makes an episode's success a draw: a plan of
moves reaches the goal with some probability, and Pass@1 averages those draws. This script reads
eval episodes (`<report>.trajectories.jsonl`, one turn a game) and computes, from the game's own
transition probabilities, each episode's *plan odds*: the probability that its answer's moves
reach the goal. Their mean estimates the same Pass@1 without the ice's noise (the expectation of
each episode's success given its plan), so differences between models show with fewer puzzles.
It also gives each puzzle's best odds, over every plan of 1 to `max_actions` moves: what any
one-turn policy could score.

    python experiments/plan_odds/plan_odds.py A.trajectories.jsonl B.trajectories.jsonl [...]

prints a JSON line per file: Pass@1 (the successes drawn), plan odds and the best possible odds, each
with a 95% interval over the puzzles; and for each file after the first, its paired difference
from the first (the same puzzles resampled for both; `stages.evaluation.metrics.bootstrap`).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import cache
from itertools import product
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from envs.frozen_lake import FrozenLakeEnv
from stages.agent.states import grid_cells
from stages.common.artifacts import read_jsonl
from stages.common.errors import UserError
from stages.evaluation.metrics import bootstrap


def board(state: str) -> FrozenLakeEnv:
    """The game at a shown state (its grid, without the coordinate line)."""
    return FrozenLakeEnv.from_grid("\n".join("".join(row) for row in grid_cells(state)))


def plan_odds(env: FrozenLakeEnv, moves: tuple[str, ...]) -> float:
    """The probability that `moves`, played from the player's cell, end on the goal (a hole or the
    goal ends the walk: `transitions` keeps a finished cell where it is)."""
    where = {env.player: 1.0}
    for move in moves:
        after: dict[tuple[int, int], float] = {}
        for cell, chance in where.items():
            for p, nxt in env.transitions(cell, env.action_names.index(move)):
                after[nxt] = after.get(nxt, 0.0) + chance * p
        where = after
    return where.get(env.goal, 0.0)


@cache
def best_odds(state: str, max_actions: int) -> float:
    """The best plan odds of any 1 to `max_actions` moves from `state`."""
    env = board(state)
    return max(plan_odds(env, moves) for n in range(1, max_actions + 1)
               for moves in product(env.action_names, repeat=n))


def per_puzzle(path: Path, max_actions: int) -> dict[int, tuple[float, float, float]]:
    """seed -> (success rate, mean plan odds, best odds) over the file's episodes of that puzzle."""
    rows: dict[int, list[tuple[float, float, float]]] = {}
    for episode in read_jsonl(path)[0]:
        turn = episode["turns"][0]
        env = board(turn["state"])
        moves = tuple(name for name in map(env.parse_action, turn["actions"]) if name)[:max_actions]
        if tuple(turn["executed"]) != moves[:len(turn["executed"])]:
            raise ValueError(f"seed {episode['seed']}: executed {turn['executed']} is not how {moves} begins")
        odds = plan_odds(env, moves)
        rows.setdefault(int(episode["seed"]), []).append(
            (float(episode["success"]), odds, best_odds(turn["state"], max_actions)))
    return {seed: tuple(sum(column) / len(column) for column in zip(*values)) for seed, values in rows.items()}


def interval(values: tuple[float, float, float]) -> list[float]:
    return [round(100 * v, 1) for v in values]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trajectories", nargs="+", type=Path)
    parser.add_argument("--max-actions", type=int, default=5, help="rollout.max_actions_per_turn of the eval")
    args = parser.parse_args()
    tables = [per_puzzle(path, args.max_actions) for path in args.trajectories]
    first = tables[0]
    for path, table in zip(args.trajectories, tables):
        seeds = sorted(table)
        pass1, odds, best = bootstrap([table[s] for s in seeds])
        found = {"puzzles": len(seeds), "pass@1": interval(pass1), "plan_odds": interval(odds),
                 "best_possible": interval(best)}
        if table is not first:
            shared = sorted(first.keys() & table.keys())
            diffs = bootstrap([[table[s][0] - first[s][0], table[s][1] - first[s][1]] for s in shared])
            found |= {"pass@1_minus_first": interval(diffs[0]), "plan_odds_minus_first": interval(diffs[1])}
        print(json.dumps({"file": str(path), **found}))


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        sys.exit(f"error: {err}")
