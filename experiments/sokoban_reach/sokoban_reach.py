"""What could any policy score on these Sokoban puzzles? Sokoban is deterministic, so a puzzle is
solvable within a budget of moves exactly when its shortest solution (`envs.sokoban_solver`, an
optimal breadth-first search) is no longer than the budget; the share of such puzzles is the best
Pass@1 any policy could reach with that many moves, and no plan is lucky.

    python experiments/sokoban_reach/sokoban_reach.py --config configs/repro_cpu/sokoban_world_model.yaml
    python experiments/sokoban_reach/sokoban_reach.py --config ... --first-seed 10000 --seeds 80

prints one JSON line: the puzzles' seeds, how many puzzles need each number of moves (None: not
solved within the solver's search limit), and for every budget from 1 to the game's (rollout.max_turns
x rollout.max_actions_per_turn, capped by max_actions_per_traj) the share solvable with a 95%
interval over the puzzles (`stages.evaluation.metrics.bootstrap`). The seeds default to the
config's eval puzzles (eval.first_seed, eval.seeds). A policy that writes one action a turn, as
the CPU world models do, has a budget of rollout.max_turns moves.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from envs import registry
from envs.sokoban_solver import solution_length
from stages.common.config import SPAConfig, load_config
from stages.common.errors import UserError
from stages.evaluation.metrics import bootstrap


def shortest_solutions(config: SPAConfig, seeds: range) -> dict[int, int | None]:
    """Each seed's fewest moves to solve its room (None when the search gives up)."""
    env = registry.make(config.env.name, **config.env.options)
    lengths = {}
    for seed in seeds:
        env.reset(seed=seed)
        lengths[seed] = solution_length(env.room)
    return lengths


def move_budget(config: SPAConfig) -> int:
    """The most moves an episode may make under the config's rules."""
    rollout = config.rollout
    budget = rollout.max_turns * rollout.max_actions_per_turn
    return min(budget, rollout.max_actions_per_traj) if rollout.max_actions_per_traj else budget


def reach(lengths: dict[int, int | None], budget: int) -> dict[str, object]:
    """The histogram of `lengths` and, for each budget 1..`budget`, the share of puzzles solvable
    within it with its 95% interval, as fractions."""
    table = [[float(length is not None and length <= moves) for moves in range(1, budget + 1)]
             for length in lengths.values()]
    shares = bootstrap(table)
    histogram = Counter(lengths.values())
    return {"seeds": [min(lengths), max(lengths)], "puzzles": len(lengths),
            "moves_needed": {str(k): histogram[k] for k in sorted(histogram, key=lambda k: (k is None, k or 0))},
            "solvable_within": {str(moves): [round(x, 4) for x in share]
                                for moves, share in zip(range(1, budget + 1), shares, strict=True)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--first-seed", type=int, help="First puzzle (default: eval.first_seed).")
    parser.add_argument("--seeds", type=int, help="Number of puzzles (default: eval.seeds).")
    args = parser.parse_args()
    try:
        config = load_config(args.config)
        if config.env.name != "sokoban":
            raise UserError(f"{args.config} plays {config.env.name}; this counts Sokoban solutions")
        first = config.eval.first_seed if args.first_seed is None else args.first_seed
        count = config.eval.seeds if args.seeds is None else args.seeds
        if count < 1:
            raise UserError(f"--seeds must be at least 1, got {count}")
        budget = move_budget(config)
        print(json.dumps({"game_budget": budget, **reach(shortest_solutions(config, range(first, first + count)), budget)}))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
