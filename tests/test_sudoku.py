"""Sudoku 4x4: unique puzzles, move rules and rewards, text formats and determinism."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import gymnasium
import pytest

import envs
from envs.base import EnvError
from envs.sudoku import SudokuEnv

REPO = Path(__file__).resolve().parents[1]

SOLUTION = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]


# ---- an independent brute-force solver -----------------------------------------------------

def is_valid_grid(grid) -> bool:
    """Rows, columns and 2x2 boxes each hold 1..4 exactly once."""
    groups = [list(row) for row in grid] + [list(col) for col in zip(*grid)]
    groups += [[grid[r][c] for r in (br, br + 1) for c in (bc, bc + 1)] for br in (0, 2) for bc in (0, 2)]
    return all(sorted(group) == [1, 2, 3, 4] for group in groups)


@lru_cache(maxsize=1)
def all_grids() -> list[tuple[tuple[int, ...], ...]]:
    """Every valid 4x4 Sudoku grid (there are 288), found by trying all row permutations."""
    perms = list(itertools.permutations((1, 2, 3, 4)))
    grids = [grid for grid in itertools.product(perms, repeat=4) if is_valid_grid(grid)]
    assert len(grids) == 288
    return grids


def brute_force_solutions(puzzle) -> list:
    return [grid for grid in all_grids()
            if all(puzzle[r][c] in (0, grid[r][c]) for r in range(4) for c in range(4))]


def clue_count(puzzle) -> int:
    return sum(v != 0 for row in puzzle for v in row)


def custom_env(puzzle, solution=SOLUTION, **kwargs) -> SudokuEnv:
    """An env on a hand-made puzzle (reset first so every attribute is initialised)."""
    env = SudokuEnv(**kwargs)
    env.reset(seed=0)
    env.solution = [row[:] for row in solution]
    env.puzzle = [row[:] for row in puzzle]
    env.board = [row[:] for row in puzzle]
    return env


def blank(grid, cells):
    return [[0 if (r, c) in cells else grid[r][c] for c in range(4)] for r in range(4)]


# ---- generation ----------------------------------------------------------------------------

def test_generated_puzzles_have_exactly_one_solution():
    env = SudokuEnv()
    for seed in range(200):
        env.reset(seed=seed)
        assert is_valid_grid(env.solution)
        assert brute_force_solutions(env.puzzle) == [tuple(tuple(row) for row in env.solution)], seed


@pytest.mark.parametrize("difficulty,clues", [("easy", 10), ("medium", 9), ("hard", 6)])
def test_clue_count_per_difficulty(difficulty, clues):
    env = SudokuEnv(difficulty=difficulty)
    for seed in range(200):
        env.reset(seed=seed)
        assert clue_count(env.puzzle) == clues, seed
        assert len(brute_force_solutions(env.puzzle)) == 1


def test_blanks_override_and_fallback_to_the_closest_unique_puzzle():
    env = SudokuEnv(blanks=3)
    env.reset(seed=1)
    assert clue_count(env.puzzle) == 13
    # 12 blanks (4 clues) is not always reachable with a unique solution: the fewest clues found
    # is kept, and then no clue can be removed without losing uniqueness.
    env = SudokuEnv(blanks=12)
    fell_back = 0
    for seed in range(60):
        env.reset(seed=seed)
        assert len(brute_force_solutions(env.puzzle)) == 1
        clues = [(r, c) for r in range(4) for c in range(4) if env.puzzle[r][c]]
        if len(clues) > 4:
            fell_back += 1
            for cell in clues:
                assert len(brute_force_solutions(blank(env.puzzle, {cell}))) > 1
    assert fell_back > 0


def test_puzzles_vary_with_the_seed():
    env = SudokuEnv()
    seen = set()
    for seed in range(50):
        env.reset(seed=seed)
        seen.add(env.render_grid())
    assert len(seen) > 45


def test_reset_is_deterministic_across_processes():
    script = (
        "import json, envs\n"
        "env = envs.make('sudoku', difficulty='hard')\n"
        "print(json.dumps([env.reset(seed=seed)[0] for seed in range(30)]))\n"
    )
    outputs = []
    for hash_seed in ("2", "31337"):
        run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed}, check=True)
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1]
    assert SudokuEnv(difficulty="hard").reset(seed=11)[0] == outputs[0][11]


# ---- moves ---------------------------------------------------------------------------------

def test_parse_action_forms():
    env = SudokuEnv()
    for text in ("1,2,3", " 1 , 2 ,3 ", "1 2 3", "  1   2 3", "place 3 at row 1 col 2", "PLACE 3 AT Row 1 COL 2",
                 "place  3 at   row 1 col 2 "):
        assert env.parse_action(text) == "1,2,3", text
    assert env.parse_action("9,0,12") == "9,0,12"  # well-formed; step rejects the range
    for text in ("", "hello", "1,2", "1,2,3,4", "1;2;3", "-1,2,3", "place 3 at row 1", "1,2,3 || 2,3,4"):
        assert env.parse_action(text) is None, text


def test_sample_action():
    env = SudokuEnv()
    rng = random.Random(0)
    samples = [env.sample_action(rng) for _ in range(500)]
    assert all(re.fullmatch(r"[1-4],[1-4],[1-4]", s) and env.parse_action(s) == s for s in samples)
    assert len(set(samples)) == 64
    assert samples[:20] == [env.sample_action(r) for r in [random.Random(0)] for _ in range(20)]


INFO_WRITTEN = {"success": False, "action_is_valid": True, "action_is_effective": True}
INFO_CONFLICT = {"success": False, "action_is_valid": True, "action_is_effective": False}
INFO_INVALID = {"success": False, "action_is_valid": False, "action_is_effective": False}


def test_valid_move_is_written():
    env = custom_env(blank(SOLUTION, {(0, 0), (3, 3)}))
    obs, reward, terminated, truncated, info = env.step("1,1,1")
    assert (reward, terminated, truncated, info) == (0.0, False, False, INFO_WRITTEN)
    assert obs == "| 1 2 3 4 | 3 4 1 2 | 2 1 4 3 | 4 3 2 . \nEmpty position to be filled is at (4,4)."


def test_conflicting_move_is_valid_but_not_applied():
    env = custom_env(blank(SOLUTION, {(0, 0), (3, 3)}))
    before = env.render()
    for move in ("1,1,2", "1,1,3", "1,1,4"):  # 2 and 4 repeat in the row, 3 in the column and box
        obs, reward, terminated, truncated, info = env.step(move)
        assert (obs, reward, terminated, truncated, reason(info)) == (before, 0.0, False, False, INFO_CONFLICT)
    # One clue, 1 at (2,2): each kind of conflict on its own (the rules need no solution for this).
    env = custom_env([[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert env.step("1,1,1")[4] == INFO_CONFLICT | {"no_effect": "1 is already in the box of (1,1)"}
    assert env.step("2,3,1")[4] == INFO_CONFLICT | {"no_effect": "1 is already in the row of (2,3)"}
    assert env.step("3,2,1")[4] == INFO_CONFLICT | {"no_effect": "1 is already in the column of (3,2)"}
    assert env.step("1,3,1")[4] == INFO_WRITTEN  # none of them
    env.step("1,4,2")
    assert env.step("2,4,2")[4]["no_effect"] == "2 is already in the column and box of (2,4)"


def reason(info: dict) -> dict:
    """`info` without the words that say why a move changed nothing (checked on their own)."""
    assert info.get("no_effect")
    return {key: value for key, value in info.items() if key != "no_effect"}


def test_invalid_moves_change_nothing():
    env = custom_env(blank(SOLUTION, {(0, 0), (3, 3)}))
    before = env.render()
    for move in ("hello", "", "5,1,1", "1,5,1", "0,1,1", "1,1,0", "1,1,5", "1,2,2", "2,1,3"):
        obs, reward, terminated, truncated, info = env.step(move)
        assert (obs, reward, terminated, truncated, reason(info)) == (before, 0.0, False, False, INFO_INVALID), move
    assert env.step("hello")[4]["no_effect"] == "not a move (r,c,v)"
    assert env.step("1,5,1")[4]["no_effect"] == "row, column and value must be 1 to 4"
    assert env.step("1,2,2")[4]["no_effect"] == "(1,2) is a clue"
    assert env.steps == 12  # invalid steps are counted too


def test_player_filled_cells_can_be_overwritten():
    # Blanking a 2x2 "deadly rectangle" leaves (1,1) free to hold 1 or 2 without a conflict.
    env = custom_env(blank(SOLUTION, {(0, 0), (0, 1), (2, 0), (2, 1)}))
    assert env.step("1,1,2")[4] == INFO_WRITTEN
    assert env.board[0][0] == 2
    assert env.step("1,1,1")[4] == INFO_WRITTEN
    assert env.board[0][0] == 1
    assert env.step("1,1,1")[4] == INFO_WRITTEN  # rewriting the same value still counts as written


def test_completing_the_board_rewards_and_terminates():
    env = SudokuEnv()
    env.reset(seed=3)
    empty = [(r, c) for r in range(4) for c in range(4) if env.puzzle[r][c] == 0]
    assert len(empty) == 6
    for i, (r, c) in enumerate(empty):
        obs, reward, terminated, truncated, info = env.step(f"{r + 1},{c + 1},{env.solution[r][c]}")
        last = i == len(empty) - 1
        assert (reward, terminated, truncated, info["success"]) == (float(last), last, False, last)
        assert info["action_is_valid"] and info["action_is_effective"]
    assert obs.endswith("\nNo empty positions found (board might be complete).")
    # Solved is absorbing: no second reward.
    r, c = empty[0]
    _, reward, terminated, _, info = env.step(f"{r + 1},{c + 1},{env.solution[r][c]}")
    assert (reward, terminated, info["action_is_effective"], info["success"]) == (0.0, True, False, True)


def test_place_form_applies_the_move():
    env = custom_env(blank(SOLUTION, {(1, 2)}))
    _, reward, terminated, _, info = env.step("Place 1 at row 2 col 3")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    env = custom_env(blank(SOLUTION, {(1, 2)}))
    assert env.step("2 3 1")[1] == 1.0


def test_truncation_at_max_steps():
    env = custom_env(blank(SOLUTION, {(0, 0), (3, 3)}), max_steps=3)
    results = [env.step(move)[3] for move in ("1,1,1", "nonsense", "1,1,2")]  # written, invalid, conflict
    assert results == [False, False, True]
    env = SudokuEnv()
    env.reset(seed=0)
    assert [env.step("9,9,9")[3] for _ in range(30)] == [False] * 29 + [True]


# ---- text formats --------------------------------------------------------------------------

def test_render_and_coordinate_lines():
    board = [[0, 1, 2, 4], [4, 2, 1, 3], [2, 3, 4, 1], [0, 4, 0, 2]]
    env = custom_env(board, solution=[[3, 1, 2, 4], [4, 2, 1, 3], [2, 3, 4, 1], [1, 4, 3, 2]])
    assert env.render_grid() == "| . 1 2 4 | 4 2 1 3 | 2 3 4 1 | . 4 . 2 "
    assert env.render() == ("| . 1 2 4 | 4 2 1 3 | 2 3 4 1 | . 4 . 2 \n"
                            "Empty positions to be filled are at (1,1), (4,1), (4,3).")
    env.step("1,1,3")
    env.step("4,1,1")
    assert env.coordinate_line() == "Empty position to be filled is at (4,3)."
    env.step("4,3,3")
    assert env.coordinate_line() == "No empty positions found (board might be complete)."
    env.render_mode = "text"
    assert env.render() == "| 3 1 2 4 | 4 2 1 3 | 2 3 4 1 | 1 4 3 2 "


def test_generated_observation_format():
    env = envs.make("sudoku")
    obs, info = env.reset(seed=42)
    grid, line = obs.split("\n")
    assert re.fullmatch(r"(\| ([1-4.] ){4}){4}", grid)
    assert grid.count(".") == 6
    assert re.fullmatch(r"Empty positions to be filled are at \([1-4],[1-4]\)(, \([1-4],[1-4]\)){5}\.", line)
    assert info == {"seed": 42, "success": False}


# ---- metadata, registry, instructions ------------------------------------------------------

def test_metadata_and_options():
    assert SudokuEnv.name == "sudoku" and SudokuEnv.action_names is None and SudokuEnv.legend is None
    assert SudokuEnv.max_actions_per_traj == 50
    assert SudokuEnv().max_steps == 30
    with pytest.raises(EnvError):
        SudokuEnv(difficulty="expert")
    with pytest.raises(EnvError):
        SudokuEnv(blanks=17)
    assert envs.make("sudoku", blanks=4).target_clues == 12


def test_gymnasium_make():
    env = gymnasium.make("spa/Sudoku-v0")
    obs, _ = env.reset(seed=5)
    assert isinstance(env.unwrapped, SudokuEnv) and obs == env.unwrapped.render()
    assert len(env.step("1,1,1")) == 5


#: SPA's Sudoku instructions (its config/envs.yaml), quoted exactly: the world-model one shares the
#: base one up to "No extra text outside the two tags.", then allows 100 words and shows a sample.
SHARED_INSTRUCTION = (
    "You are solving 4x4 Sudoku. Fill empty cells with digits 1\u20134. Use a 1-indexed grid (rows/cols start "
    "at 1). A move is exactly: row,col,value (three integers). In one turn you may output multiple moves, "
    "separated by ||. Only propose moves that keep the row, column, and 2x2 subgrid valid. Always output "
    "EXACTLY: <think>[brief reasoning]</think> <answer>[r,c,v || r,c,v ...]</answer> No extra text outside "
    "the two tags."
)
BASE_INSTRUCTION = SHARED_INSTRUCTION + (
    " Keep the response under 50 words. Example: <think>Row 1 has one empty cell \u2192 place 1. Column 2 "
    "then needs 2.</think> <answer>1,3,1 || 3,2,2</answer>"
)
WORLD_MODEL_INSTRUCTION = SHARED_INSTRUCTION + (
    " Keep the response under 100 words. An example output: <think> <observation>| . . 1 4 | 1 4 . 3 | "
    "4 2 . . | . 1 4 2 \nEmpty positions to be filled are at (1,1), (1,2), (2,3), (3,3), (3,4), (4,1)"
    "</observation> <prediction>| 2 3 1 4 | 1 4 2 3 | 4 2 3 1 | . 1 4 2\n Empty positions to be filled are "
    "at (4,1)</prediction> </think> <answer> 1,1,2 || 1,2,3 || 2,3,2 || 3,3,3 || 3,4,1 </answer>."
)


def test_instruction_texts_quote_spa_exactly():
    assert SudokuEnv().instruction("base") == BASE_INSTRUCTION
    assert SudokuEnv().instruction("world_model") == WORLD_MODEL_INSTRUCTION
