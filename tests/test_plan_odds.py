"""experiments/plan_odds: the odds of a FrozenLake plan from the game's transitions, by hand on a
2x2 board, and the per-puzzle table it reads from eval episodes."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Player top left, goal top right. Right slips Down / Right / Up (1/3 each): the goal, (1,0), or
#: the edge (stays). Up slips Right / Up / Left: the goal 1/3, else it stays on (0,0).
BOARD = "PG\n__"


def load_plan_odds():
    spec = importlib.util.spec_from_file_location("plan_odds", ROOT / "experiments" / "plan_odds" / "plan_odds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("moves, odds", [
    (("Right",), 1 / 3),
    (("Right", "Right"), 1 / 3 + 1 / 3 * 1 / 3),  # from (1,0) Right cannot reach the goal
    (("Up", "Right"), 1 / 3 + 2 / 3 * 1 / 3),  # Up keeps every miss on the start
    (("Left",), 0.0),  # slips Up / Left / Down: never Right
    ((), 0.0),
])
def test_plan_odds_by_hand(moves, odds):
    module = load_plan_odds()
    assert module.plan_odds(module.board(BOARD), moves) == pytest.approx(odds, abs=1e-12)


def test_the_best_plan_is_found_among_every_plan():
    module = load_plan_odds()
    assert module.best_odds(BOARD, 1) == pytest.approx(1 / 3, abs=1e-12)
    assert module.best_odds(BOARD, 2) == pytest.approx(5 / 9, abs=1e-12)  # Up then Up, or Up then Right
    assert module.best_odds(BOARD, 3) == pytest.approx(1 - (2 / 3) ** 3, abs=1e-12)


def episode(seed, actions, executed, success):
    return {"seed": seed, "success": success,
            "turns": [{"state": BOARD + "\nPlayer (P) is at (0,0); goal (G) is at (0,1).", "actions": actions,
                       "executed": executed}]}


def test_per_puzzle_averages_each_puzzles_episodes(tmp_path):
    module = load_plan_odds()
    path = tmp_path / "t.jsonl"
    rows = [episode(1, ["Right"], ["Right"], True), episode(1, ["Left", "jump"], ["Left"], False),
            episode(2, ["Up", "Right"], ["Up", "Right"], False)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    table = module.per_puzzle(path, max_actions=2)
    assert table[1] == pytest.approx((0.5, (1 / 3 + 0) / 2, 5 / 9))  # "jump" is no move
    assert table[2] == pytest.approx((0.0, 5 / 9, 5 / 9))


def test_episodes_whose_moves_are_not_the_plan_are_refused(tmp_path):
    module = load_plan_odds()
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(episode(1, ["Right"], ["Up"], False)) + "\n")
    with pytest.raises(ValueError, match="is not how"):
        module.per_puzzle(path, max_actions=5)
