"""Sokoban: push rules, rewards, text formats, instructions, room generation and the solver."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import deque
from pathlib import Path

import gymnasium
import pytest

import envs
from envs.base import EnvError
from envs.sokoban import Room, SokobanEnv, generate_room, parse_grid
from envs.sokoban_solver import live_cells, solution_length, solve, solve_grid

REPO = Path(__file__).resolve().parents[1]


def grid(*rows: str) -> str:
    return "\n".join(rows)


def step_all(env: SokobanEnv, actions) -> list[tuple]:
    return [env.step(a) for a in actions]


# ---- push rules and rewards ----------------------------------------------------------------

OPEN_ROOM = grid(
    "######",
    "#P___#",
    "#_XO_#",
    "#____#",
    "######",
)


def test_walking_into_a_wall_moves_nothing_but_counts():
    env = SokobanEnv.from_grid(OPEN_ROOM)
    before = env.render()
    obs, reward, terminated, truncated, info = env.step("Up")
    assert obs == before
    assert reward == -0.1
    assert (terminated, truncated) == (False, False)
    assert info == {"success": False, "action_is_valid": True, "action_is_effective": False,
                    "no_effect": "a wall is in the way"}
    assert env.num_env_steps == 1


def test_walking_onto_empty_floor_moves_the_player():
    env = SokobanEnv.from_grid(OPEN_ROOM)
    obs, reward, _, _, info = env.step("Right")
    assert obs.split("\n")[1] == "#_P__#"
    assert reward == -0.1
    assert info["action_is_effective"] is True


def test_pushing_a_box_into_a_wall_moves_nothing():
    env = SokobanEnv.from_grid(grid(
        "#####",
        "#_O_#",
        "#PX##",
        "#####",
    ))
    before = env.render()
    obs, reward, _, _, info = env.step("Right")
    assert obs == before
    assert reward == -0.1
    assert info["action_is_effective"] is False


def test_pushing_a_box_into_another_box_moves_nothing():
    env = SokobanEnv.from_grid(grid(
        "#######",
        "#PXX__#",
        "#__OO_#",
        "#######",
    ))
    before = env.render()
    obs, reward, _, _, info = env.step("Right")
    assert obs == before
    assert reward == -0.1
    assert info["action_is_effective"] is False


def test_pushing_a_box_onto_a_target_earns_one():
    env = SokobanEnv.from_grid(grid(
        "#######",
        "#PXO__#",
        "#__X_O#",
        "#######",
    ))
    obs, reward, terminated, truncated, info = env.step("Right")
    assert obs.split("\n")[:3] == ["#######", "#_P√__#", "#__X_O#"]
    assert reward == 0.9
    assert (terminated, truncated, info["success"]) == (False, False, False)


def test_pushing_a_box_off_a_target_costs_one():
    env = SokobanEnv.from_grid(grid(
        "#######",
        "#P√___#",
        "#__X_O#",
        "#######",
    ))
    obs, reward, _, _, info = env.step("Right")
    assert obs.split("\n")[1] == "#_SX__#"
    assert reward == -1.1
    assert info["action_is_effective"] is True


def test_solving_earns_ten_more_and_terminates():
    env = SokobanEnv.from_grid(grid(
        "#####",
        "#PXO#",
        "#####",
    ))
    obs, reward, terminated, truncated, info = env.step("Right")
    assert obs == grid("#####", "#_P√#", "#####") + "\nPlayer (P) is at (1,2); box on target (√) is at (1,3)."
    assert reward == 10.9
    assert (terminated, truncated) == (True, False)
    assert info == {"success": True, "action_is_valid": True, "action_is_effective": True}


def test_solving_in_five_moves_sums_to_ten_and_a_half():
    env = SokobanEnv.from_grid(grid("######", "#P___#", "#_X__#", "#__O_#", "######"))
    actions = solve(env.room)
    assert len(actions) == 5
    rewards = [r for _, r, _, _, _ in step_all(env, actions)]
    assert rewards == [-0.1, -0.1, -0.1, -0.1, 10.9]
    assert sum(rewards) == pytest.approx(10.5)


def test_truncation_at_max_steps():
    env = SokobanEnv.from_grid(OPEN_ROOM, max_steps=3)
    results = step_all(env, ["Up", "Left", "Up"])
    assert [(t, tr) for _, _, t, tr, _ in results] == [(False, False), (False, False), (False, True)]


def test_a_solve_on_the_last_allowed_step_is_terminated_not_truncated():
    env = SokobanEnv.from_grid(grid("#####", "#PXO#", "#####"), max_steps=1)
    _, reward, terminated, truncated, info = env.step("Right")
    assert (reward, terminated, truncated, info["success"]) == (10.9, True, False, True)


@pytest.mark.parametrize("text", ["jump", "", "Up || Down", "U", "<answer>Up</answer>", "Upp"])
def test_text_that_is_not_an_action_changes_nothing(text):
    env = SokobanEnv.from_grid(OPEN_ROOM, max_steps=1)
    before = env.render()
    obs, reward, terminated, truncated, info = env.step(text)
    assert obs == before
    assert reward == 0.0
    assert (terminated, truncated) == (False, False)
    assert info == {"success": False, "action_is_valid": False, "action_is_effective": False,
                    "no_effect": "not an action"}
    assert env.num_env_steps == 0


@pytest.mark.parametrize("text", [" up ", "RIGHT", "down\n", "lEfT"])
def test_action_text_is_case_and_space_tolerant(text):
    env = SokobanEnv.from_grid(OPEN_ROOM)
    _, reward, _, _, info = env.step(text)
    assert info["action_is_valid"] is True
    assert reward == -0.1


def test_world_model_sample_output_replays_exactly():
    """The sample in SPA's world-model instruction: Down, Left, Down from its observation."""
    observation = grid("######", "#_####", "#_P###", "#_X#_#", "#__O_#", "######")
    env = SokobanEnv.from_grid(observation)
    assert env.coordinate_line() == "Player (P) is at (2,2); box (X) is at (3,2); target (O) is at (4,3)."
    step_all(env, ["Down", "Left", "Down"])
    assert env.render_grid() == grid("######", "#_####", "#__###", "#__#_#", "#PXO_#", "######")


# ---- text formats ----------------------------------------------------------------------------

def test_spa_dataset_state_format():
    text = grid("######", "#P___#", "#_XO_#", "######", "######", "######")
    env = SokobanEnv.from_grid(text)
    expected = text + "\nPlayer (P) is at (1,1); box (X) is at (2,2); target (O) is at (2,3)."
    assert env.render() == expected
    assert env.render_text(coordinates=False) == text


def test_text_render_mode_gives_the_grid_alone():
    text = grid("######", "#P___#", "#_XO_#", "######", "######", "######")
    env = SokobanEnv.from_grid(text, render_mode="text")
    assert env.render() == text


def test_player_on_target_and_box_on_target_format():
    env = SokobanEnv.from_grid(grid(
        "######",
        "#S_X_#",
        "#_√__#",
        "######",
    ))
    assert env.coordinate_line() == ("Player on target (S) is at (1,1); box (X) is at (1,3); "
                                     "box on target (√) is at (2,2).")


def test_several_boxes_and_targets_are_listed_row_major():
    env = SokobanEnv.from_grid(grid(
        "#######",
        "#O_X_√#",
        "#_XP_O#",
        "#X_√_O#",
        "#######",
    ))
    assert env.coordinate_line() == (
        "Player (P) is at (2,3); boxes (X) are at (1,3), (2,2), (3,1); "
        "boxes on target (√) are at (1,5), (3,3); targets (O) are at (1,1), (2,5), (3,5).")


def test_missing_items_are_left_out():
    env = SokobanEnv.from_grid(grid("#####", "#P√√#", "#####"))
    assert env.coordinate_line() == "Player (P) is at (1,1); boxes on target (√) are at (1,2), (1,3)."


def test_render_round_trips_through_from_grid():
    env = SokobanEnv(dim=10, num_boxes=2, render_mode="text")
    for seed in range(20):
        text = env.reset(seed=seed)[0]
        assert SokobanEnv.from_grid(text, render_mode="text").render() == text


@pytest.mark.parametrize("text, message", [
    ("#####\n#P#\n#####", "same length"),
    ("#####\n#PXa#\n#####", "unknown Sokoban symbol"),
    ("#####\n_PXO#\n#####", "outer ring"),
    ("#####\n#_XO#\n#####", "exactly one player"),
    ("######\n#PXX_#\n#__O_#\n######", "as many boxes as targets"),
    ("#####\n#P_O#\n#####", "as many boxes as targets"),
])
def test_bad_grids_are_refused(text, message):
    with pytest.raises(EnvError, match=message):
        SokobanEnv.from_grid(text)


def test_step_before_reset_is_refused():
    with pytest.raises(EnvError, match="reset"):
        SokobanEnv().step("Up")


# ---- prompt texts ----------------------------------------------------------------------------

RELEASED_BASE_INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets You "
    "are provided with a symbol grid. When you are exactly next to a box, you can push it by moving in the "
    "same direction. You cannot push a box through a wall, and you cannot pull a box. The answer should be "
    "a sequence of actions, like <answer>Right || Right || Up</answer>."
)
WORLD_MODEL_INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets You "
    "are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and each "
    "target. Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). When you "
    "are exactly next to a box, you can push it by moving in the same direction. You cannot push a box "
    "through a wall, and you cannot pull a box. The answer should be a sequence of actions, like "
    "<answer>Right || Right || Up</answer>. A sample full output is as follows: <think> <observation>"
    "######\n#_####\n#_P###\n#_X#_#\n#__O_#\n######\nPlayer (P) is at (2,2); box (X) is at (3,2); target "
    "(O) is at (4,3).</observation> 1 Down – I push box to (4,2). 2 Left – I step to (3,1). 3 Down – I "
    "stand left of box, ready to push it Right onto target. <prediction>######\n#_####\n#__###\n#__#_#\n"
    "#PXO_#\n######</prediction> </think> <answer> Down || Left || Down </answer>"
)


# The paper's App. A base prompt: the released text with the world-model prompt's coordinate sentences.
PAPER_BASE_INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets You "
    "are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and each "
    "target. Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). When you "
    "are exactly next to a box, you can push it by moving in the same direction. You cannot push a box "
    "through a wall, and you cannot pull a box. The answer should be a sequence of actions, like "
    "<answer>Right || Right || Up</answer>."
)
# Ours, for the grid alone: no coordinate sentence, no coordinate line, no positions in the reasoning.
WORLD_MODEL_INSTRUCTION_WITHOUT_COORDINATES = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets You "
    "are provided with a symbol grid. When you are exactly next to a box, you can push it by moving in the "
    "same direction. You cannot push a box through a wall, and you cannot pull a box. The answer should be "
    "a sequence of actions, like <answer>Right || Right || Up</answer>. A sample full output is as follows: "
    "<think> <observation>######\n#_####\n#_P###\n#_X#_#\n#__O_#\n######</observation> 1 Down – I push box "
    "down. 2 Left – I step left. 3 Down – I stand left of box, ready to push it Right onto target. "
    "<prediction>######\n#_####\n#__###\n#__#_#\n#PXO_#\n######</prediction> </think> <answer> Down || "
    "Left || Down </answer>"
)


def test_instructions_quote_spa_exactly():
    env = SokobanEnv(base_instruction="released")
    assert env.instruction("base") == RELEASED_BASE_INSTRUCTION
    assert env.instruction("world_model") == WORLD_MODEL_INSTRUCTION
    assert "\u2013" in env.instruction("world_model")


def test_the_default_base_instruction_is_the_papers():
    env = SokobanEnv()
    assert env.instruction("base") == PAPER_BASE_INSTRUCTION
    assert SokobanEnv.instructions == {"base": PAPER_BASE_INSTRUCTION, "world_model": WORLD_MODEL_INSTRUCTION}
    with pytest.raises(EnvError, match="base_instruction must be one of paper, released"):
        SokobanEnv(base_instruction="appendix")


@pytest.mark.parametrize("base_instruction", ["paper", "released"])
def test_without_coordinates_no_instruction_promises_them(base_instruction):
    env = SokobanEnv(render_mode="text", base_instruction=base_instruction)
    assert env.instruction("base") == RELEASED_BASE_INSTRUCTION
    assert env.instruction("world_model") == WORLD_MODEL_INSTRUCTION_WITHOUT_COORDINATES
    for text in (env.instruction("base"), env.instruction("world_model")):
        assert "coordinates" not in text and not re.search(r"\(\d+, ?\d+\)", text)


def test_world_model_instruction_names_the_bottom_right_corner_of_bigger_rooms():
    text = SokobanEnv(dim=10, num_boxes=2).instruction("world_model")
    assert "bottom-right corner (9, 9)." in text
    assert text == WORLD_MODEL_INSTRUCTION.replace("corner (5, 5)", "corner (9, 9)")


def test_game_metadata():
    assert SokobanEnv.name == "sokoban"
    assert SokobanEnv.action_names == ("Up", "Down", "Left", "Right")
    assert list(SokobanEnv.legend.items()) == [
        ("#", "wall"), ("_", "empty"), ("O", "target"), ("√", "box on target"), ("X", "box"),
        ("P", "player"), ("S", "player on target")]
    assert SokobanEnv.max_actions_per_traj == 10


# ---- room generation -------------------------------------------------------------------------

def check_generated(room: Room, dim: int, num_boxes: int) -> None:
    assert (room.height, room.width) == (dim, dim)
    assert len(room.boxes) == len(room.targets) == num_boxes
    ring = [c for c in range(dim * dim) if c // dim in (0, dim - 1) or c % dim in (0, dim - 1)]
    assert all(room.walls[c] for c in ring)
    assert not room.walls[room.player]
    assert not any(room.walls[b] for b in room.boxes)
    assert len(set(room.boxes) | {room.player}) == num_boxes + 1
    assert not set(room.boxes) & room.target_set, "generated rooms start with every box off target"


@pytest.mark.parametrize("dim, num_boxes, seeds", [(6, 1, 200), (10, 2, 60)])
def test_generated_rooms_are_solvable_and_unsolved(dim, num_boxes, seeds):
    env = SokobanEnv(dim=dim, num_boxes=num_boxes)
    for seed in range(seeds):
        obs, info = env.reset(seed=seed)
        assert obs == env.render()
        assert info["success"] is False
        check_generated(env.room, dim, num_boxes)
        actions = solve(env.room)
        assert actions, f"seed {seed}: unsolvable or already solved"
        results = step_all(env, actions)
        assert results[-1][2] is True and results[-1][4]["success"] is True


def test_same_seed_same_room_and_seeds_differ():
    env = SokobanEnv()
    first = [env.reset(seed=s)[0] for s in range(30)]
    assert first == [env.reset(seed=s)[0] for s in range(30)]
    assert len(set(first)) > 20


def test_reset_restarts_the_step_count():
    env = SokobanEnv(max_steps=2)
    env.reset(seed=1)
    step_all(env, ["Up", "Up"])
    env.reset(seed=1)
    assert env.step("Up")[3] is False


def test_rooms_are_the_same_in_another_process_with_another_hash_seed():
    code = ("import json; from envs.sokoban import SokobanEnv\n"
            "print(json.dumps([SokobanEnv(dim=d, num_boxes=b).reset(seed=s)[0]\n"
            "                  for d, b in ((6, 1), (10, 2)) for s in range(8)]))")
    renders = []
    for hash_seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                             text=True, check=True).stdout
        renders.append(json.loads(out))
    here = [SokobanEnv(dim=d, num_boxes=b).reset(seed=s)[0] for d, b in ((6, 1), (10, 2)) for s in range(8)]
    assert renders[0] == renders[1] == here


def test_known_rooms_for_fixed_seeds():
    """Pins the generator: a change to it changes every seed's puzzle, so it must be deliberate."""
    env = SokobanEnv()
    assert env.reset(seed=0)[0] == PINNED_SEED_0


PINNED_SEED_0 = grid(
    "######",
    "#____#",
    "#__XP#",
    "#_####",
    "#O####",
    "######",
) + "\nPlayer (P) is at (2,4); box (X) is at (2,3); target (O) is at (4,1)."


def test_search_depth_bounds_the_number_of_pulls():
    for seed in range(50):
        room = generate_room(random.Random(seed), 6, 1, search_depth=1)
        (box,), (target,) = room.boxes, room.targets
        assert abs(box // 6 - target // 6) + abs(box % 6 - target % 6) == 1


def test_bad_options_are_refused():
    for kwargs in ({"dim": 4}, {"num_boxes": 0}, {"max_steps": 0}, {"search_depth": 0}):
        with pytest.raises(EnvError):
            SokobanEnv(**kwargs)
    with pytest.raises(EnvError):
        SokobanEnv(render_mode="rgb_array")


def test_a_room_size_too_small_for_its_boxes_fails_with_a_clear_error():
    with pytest.raises(EnvError, match="no solvable 5x5 Sokoban room with 8 boxes"):
        SokobanEnv(dim=5, num_boxes=8).reset(seed=0)


# ---- registry and gymnasium ------------------------------------------------------------------

def test_registry_variants():
    easy, hard = envs.make("sokoban"), envs.make("sokoban_hard")
    easy.reset(seed=3)
    hard.reset(seed=3)
    assert (easy.room.height, easy.room.width, len(easy.room.boxes)) == (6, 6, 1)
    assert (hard.room.height, hard.room.width, len(hard.room.boxes)) == (10, 10, 2)
    assert easy.max_steps == hard.max_steps == 100
    assert envs.make("sokoban", num_boxes=2).num_boxes == 2


def test_gymnasium_make():
    env = gymnasium.make("spa/Sokoban-v0")
    obs, info = env.reset(seed=7)
    assert isinstance(env.unwrapped, SokobanEnv)
    assert obs == env.unwrapped.render() and info["seed"] == 7
    obs, reward, _, _, info = env.step("Up")
    assert isinstance(obs, str) and isinstance(reward, float) and info["action_is_valid"]
    hard = gymnasium.make("spa/SokobanHard-v0")
    hard.reset(seed=7)
    assert hard.unwrapped.dim == 10 and hard.unwrapped.num_boxes == 2


# ---- the solver ------------------------------------------------------------------------------

def plain_bfs_length(room: Room) -> int | None:
    """Fewest moves by a BFS with no pruning at all, to check the solver's optimality."""
    targets = set(room.targets)
    start = (room.player, tuple(sorted(room.boxes)))
    depth = {start: 0}
    queue = deque([start])
    while queue:
        player, boxes = state = queue.popleft()
        if set(boxes) == targets:
            return depth[state]
        for a in range(4):
            step = room.offset(a)
            ahead = player + step
            if room.walls[ahead]:
                continue
            new_boxes = boxes
            if ahead in boxes:
                if room.walls[ahead + step] or ahead + step in boxes:
                    continue
                new_boxes = tuple(sorted(ahead + step if b == ahead else b for b in boxes))
            new = (ahead, new_boxes)
            if new not in depth:
                depth[new] = depth[state] + 1
                queue.append(new)
    return None


def test_solver_on_hand_made_rooms():
    assert solve_grid(grid("#####", "#PXO#", "#####")) == ["Right"]
    assert solve_grid(grid("#####", "#P√_#", "#####")) == []
    assert solve_grid(grid("######", "#OPX_#", "######")) is None  # the box can only go right
    assert solve_grid(grid("######", "#____#", "#_XP_#", "#_O__#", "######")) == ["Up", "Left", "Down"]
    two_boxes = solve_grid(grid("######", "#_X_O#", "#PX_O#", "######"))
    assert two_boxes == ["Right", "Right", "Left", "Left", "Up", "Right", "Right"]


def test_dead_cells_are_the_cells_a_lone_box_cannot_leave_for_a_target():
    room = parse_grid(grid("######", "#P___#", "#_O_X#", "#____#", "######"))
    live = {(c // 6, c % 6) for c in live_cells(room)}
    assert live == {(2, 2), (2, 3)}  # pushing from (1,2) or (2,1) needs the player inside a wall


@pytest.mark.parametrize("dim, num_boxes, seeds", [(6, 1, 40), (10, 2, 15)])
def test_solver_is_optimal_against_a_plain_bfs(dim, num_boxes, seeds):
    env = SokobanEnv(dim=dim, num_boxes=num_boxes)
    for seed in range(seeds):
        env.reset(seed=seed)
        assert solution_length(env.room) == plain_bfs_length(env.room)
