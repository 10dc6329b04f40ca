"""experiments/sokoban_reach: the share of Sokoban puzzles any policy could solve within a budget
of moves, from each room's shortest solution."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from envs import registry
from envs.sokoban_solver import solve
from stages.common.config import load_config

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "experiments" / "sokoban_reach" / "sokoban_reach.py"


def load_reach():
    spec = importlib.util.spec_from_file_location("sokoban_reach", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_share_solvable_within_each_budget_counts_the_puzzles_whose_shortest_solution_fits():
    found = load_reach().reach({5: 1, 6: 3, 7: None, 8: 2}, 3)
    assert found["seeds"] == [5, 8] and found["puzzles"] == 4
    assert found["moves_needed"] == {"1": 1, "2": 1, "3": 1, "None": 1}
    shares = found["solvable_within"]
    assert [shares[m][0] for m in ("1", "2", "3")] == [0.25, 0.5, 0.75]
    assert all(low <= mean <= high for mean, low, high in shares.values())


def test_each_rooms_length_is_its_optimal_solution_and_the_budget_follows_the_rules():
    module = load_reach()
    config = load_config(ROOT / "configs" / "repro_cpu" / "sokoban_world_model.yaml")
    lengths = module.shortest_solutions(config, range(123, 127))
    env = registry.make("sokoban")
    for seed, length in lengths.items():
        env.reset(seed=seed)
        assert length == len(solve(env.room))
    # 2 turns of up to 5 actions, at most 10 a game (base.yaml)
    assert (config.rollout.max_turns, config.rollout.max_actions_per_turn) == (2, 5)
    assert module.move_budget(config) == 10
    assert module.move_budget(load_config(None, ["rollout.max_turns=3", "rollout.max_actions_per_traj=12"])) == 12
    assert module.move_budget(load_config(None, ["rollout.max_turns=1", "rollout.max_actions_per_traj=null"])) == 5


@pytest.mark.parametrize("args, says", [
    (["--config", "configs/demo.yaml"], "plays frozen_lake; this counts Sokoban solutions"),
    (["--config", "configs/repro_cpu/sokoban_world_model.yaml", "--seeds", "0"], "--seeds must be at least 1"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, says):
    result = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 2 and result.stderr.startswith("error: ")
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1
