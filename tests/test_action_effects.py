"""What an action would do, per game, on hand-built positions: `action_effect`, `probe_actions` and
`next_states` (what `spa probe` splits its figures by and scores against)."""

from __future__ import annotations

import pytest

from envs.base import EnvError
from envs.frozen_lake import FrozenLakeEnv
from envs.sokoban import SokobanEnv
from envs.sudoku import SudokuEnv


def test_sokoban_effects_of_every_action():
    # Up: wall. Down: free floor. Right: box with floor behind it. Left: box with a wall behind it.
    env = SokobanEnv.from_grid("#######\n#XP_XO#\n#__O__#\n#######")
    assert env.probe_actions() == ["Up", "Down", "Left", "Right"]
    effects = {a: env.action_effect(a) for a in env.probe_actions()}
    assert effects == {"Up": "wall", "Down": "move", "Left": "push_blocked", "Right": "move"}
    env.step("Right")
    assert env.action_effect("Right") == "push"  # P now left of the box, floor target behind it
    env.step("Right")
    assert env.action_effect("Right") == "push_blocked"  # box on target against the wall
    env.load_grid("######\n#PXX_#\n#O_O_#\n######")
    assert env.action_effect("Right") == "push_blocked"  # a box behind the box


def test_sokoban_effects_change_nothing_and_next_state_is_the_step():
    env = SokobanEnv.from_grid("######\n#PX_O#\n#____#\n######")
    before = env.render()
    assert env.action_effect("right") == "push"
    [after] = env.next_states("Right")
    assert env.render() == before and env.num_env_steps == 0
    env.step("Right")
    assert after == env.render()
    with pytest.raises(EnvError):
        env.action_effect("Jump")


def test_frozen_lake_effects_of_the_intended_step():
    env = FrozenLakeEnv.from_grid("P_O\n___\n__G")
    assert [env.action_effect(a) for a in ("Left", "Down", "Right", "Up")] == ["edge", "move", "move", "edge"]
    env.player = (0, 1)
    assert env.action_effect("Right") == "hole"
    env.player = (1, 2)
    assert env.action_effect("Down") == "goal" and env.action_effect("Up") == "hole"
    env.player = (2, 2)
    assert env.action_effect("Left") == "over"


def test_frozen_lake_next_states_intended_first_then_the_slips():
    env = FrozenLakeEnv.from_grid("P_O\n___\n__G")
    # Down from (0,0): intended (1,0); slips Left -> edge, stays at (0,0); Right -> (0,1).
    states = env.next_states("Down")
    assert [s.split("\n")[:3] for s in states] == [["__O", "P__", "__G"], ["P_O", "___", "__G"],
                                                    ["_PO", "___", "__G"]]
    assert env.player == (0, 0) and env.render().startswith("P_O")
    assert "Player (P) is at (1,0)" in states[0]
    env.is_slippery = False
    assert len(env.next_states("Down")) == 1


def test_sudoku_probe_actions_and_effects():
    solution = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
    puzzle = [row[:] for row in solution]
    puzzle[0][0] = 0
    puzzle[3][3] = 0
    env = SudokuEnv()
    env.reset(seed=0)
    env.solution, env.puzzle, env.board = solution, puzzle, [row[:] for row in puzzle]
    assert env.probe_actions() == [f"1,1,{v}" for v in range(1, 5)] + [f"4,4,{v}" for v in range(1, 5)]
    assert [env.action_effect(a) for a in env.probe_actions()] == \
        ["fill", "conflict", "conflict", "conflict", "fill", "conflict", "conflict", "conflict"]
    assert env.action_effect("1,2,3") == "invalid"  # a clue
    [after] = env.next_states("1,1,1")
    assert after.startswith("| 1 2 3 4 ") and env.board[0][0] == 0
    [same] = env.next_states("1,1,2")
    assert same == env.render()
