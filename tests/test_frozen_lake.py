"""FrozenLake: gymnasium-equal dynamics, map generation, text formats and episode bookkeeping."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gymnasium
import pytest
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake

import envs
from envs.base import EnvError
from envs.frozen_lake import FrozenLakeEnv

REPO = Path(__file__).resolve().parents[1]
LEFT, DOWN, RIGHT, UP = range(4)


class FixedRng:
    """Stands in for the env's random.Random so a test can pick which slip outcome happens."""

    def __init__(self, index: int):
        self.index = index

    def randrange(self, n: int) -> int:
        assert 0 <= self.index < n
        return self.index


def custom_env(holes, start, goal, size=4, **kwargs) -> FrozenLakeEnv:
    """An env on a hand-made map (reset first so every attribute is initialised)."""
    env = FrozenLakeEnv(size=size, **kwargs)
    env.reset(seed=0)
    env.holes, env.start, env.goal, env.player = set(holes), start, goal, start
    return env


def cell_of(state: int, size: int) -> tuple[int, int]:
    return divmod(state, size)


# ---- dynamics against gymnasium ------------------------------------------------------------

def our_outcomes(env: FrozenLakeEnv, state: int, action: int) -> Counter:
    """Multiset of (prob, next_state, reward, terminated), each outcome produced by a real step."""
    cell = cell_of(state, env.size)
    found = Counter()
    for index, (prob, expected) in enumerate(env.transitions(cell, action)):
        env.player, env.steps = cell, 0
        env._rng = FixedRng(index)
        _, reward, terminated, _, _ = env.step(env.action_names[action])
        assert env.player == expected
        found[(round(prob, 9), env.player[0] * env.size + env.player[1], reward, terminated)] += 1
    return found


@pytest.mark.parametrize("size,seeds,slippery", [(4, range(25), True), (6, range(8), True), (4, range(5), False)])
def test_transition_table_matches_gymnasium(size, seeds, slippery):
    for seed in seeds:
        env = FrozenLakeEnv(size=size, is_slippery=slippery)
        env.reset(seed=seed)
        gym_env = GymFrozenLake(desc=env.desc, is_slippery=slippery)
        for state in range(size * size):
            for action in range(4):
                expected = Counter(
                    (round(prob, 9), nxt, float(reward), bool(term))
                    for prob, nxt, reward, term in gym_env.P[state][action]
                )
                assert our_outcomes(env, state, action) == expected, (seed, state, action)


def test_slip_frequencies_are_one_third_each():
    env = custom_env(holes=[], start=(1, 1), goal=(3, 3))
    env._rng = random.Random(1234)
    counts = Counter()
    draws = 3000
    for _ in range(draws):
        env.player, env.steps = (1, 1), 0
        env.step("Down")
        counts[env.player] += 1
    # Down slips to Left (1,0), goes Down (2,1) or slips to Right (1,2).
    assert set(counts) == {(1, 0), (2, 1), (1, 2)}
    for cell in counts:
        assert abs(counts[cell] / draws - 1 / 3) < 0.05


def test_not_slippery_goes_where_intended():
    env = custom_env(holes=[], start=(1, 1), goal=(3, 3), is_slippery=False)
    for name, cell in [("Left", (1, 0)), ("Down", (2, 1)), ("Right", (1, 2)), ("Up", (0, 1))]:
        env.player = (1, 1)
        env.step(name)
        assert env.player == cell


# ---- map generation ------------------------------------------------------------------------

def bfs_reachable(desc: list[str]) -> bool:
    size = len(desc)
    start = next((r, c) for r in range(size) for c in range(size) if desc[r][c] == "S")
    seen, frontier = {start}, [start]
    while frontier:
        r, c = frontier.pop(0)
        if desc[r][c] == "G":
            return True
        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= nr < size and 0 <= nc < size and desc[nr][nc] != "H" and (nr, nc) not in seen:
                seen.add((nr, nc))
                frontier.append((nr, nc))
    return False


def test_maps_are_solvable_with_random_start_and_goal():
    env = FrozenLakeEnv()
    starts, goals, hole_counts = set(), set(), []
    for seed in range(500):
        env.reset(seed=seed)
        desc = env.desc
        assert sum(row.count("S") for row in desc) == 1 and sum(row.count("G") for row in desc) == 1
        assert env.start != env.goal
        assert env.start not in env.holes and env.goal not in env.holes
        assert bfs_reachable(desc), seed
        starts.add(env.start)
        goals.add(env.goal)
        hole_counts.append(len(env.holes))
    assert len(starts) == 16 and len(goals) == 16  # not fixed corners
    assert 1.0 < sum(hole_counts) / len(hole_counts) < 3.5  # about 20% of the 14 other cells


def test_each_seed_gives_its_own_map():
    env = FrozenLakeEnv()
    maps = set()
    for seed in range(50):
        env.reset(seed=seed)
        maps.add(tuple(env.desc))
    assert len(maps) > 40


def test_reset_is_deterministic_across_processes():
    script = (
        "import json, envs\n"
        "env = envs.make('frozen_lake')\n"
        "out = []\n"
        "for seed in range(20):\n"
        "    obs, _ = env.reset(seed=seed)\n"
        "    out.append([obs] + [env.step(a)[0] for a in ['Up', 'Left', 'Down', 'Right', 'Up']])\n"
        "print(json.dumps(out))\n"
    )
    outputs = []
    for hash_seed in ("1", "987"):
        run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed}, check=True)
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1]
    env = envs.make("frozen_lake")
    env.reset(seed=7)
    assert env.render() == outputs[0][7][0]


# ---- text formats --------------------------------------------------------------------------

def example_env() -> FrozenLakeEnv:
    """The map of SPA's prompt example: _O__ / O___ / G___ / __P_."""
    return custom_env(holes=[(0, 1), (1, 0)], start=(3, 2), goal=(2, 0), is_slippery=False)


def test_render_matches_spa_prompt_example():
    env = example_env()
    assert env.render_grid() == "_O__\nO___\nG___\n__P_"
    assert env.coordinate_line() == "Player (P) is at (3,2); holes (O) are at (0,1), (1,0); goal (G) is at (2,0)."
    assert env.render() == env.render_grid() + "\n" + env.coordinate_line()
    env.render_mode = "text"
    assert env.render() == "_O__\nO___\nG___\n__P_"


def test_render_player_in_hole_and_on_goal():
    env = example_env()
    env.player = (0, 1)
    assert env.render_grid() == "_X__\nO___\nG___\n____"  # the start cell shows as ice
    assert env.coordinate_line() == "Player in hole (X) is at (0,1); hole (O) is at (1,0); goal (G) is at (2,0)."
    env.player = (2, 0)
    assert env.render_grid() == "_O__\nO___\n√___\n____"
    assert env.coordinate_line() == "Player on goal (√) is at (2,0); holes (O) are at (0,1), (1,0)."


def test_coordinate_line_without_holes_and_with_one_hole():
    env = custom_env(holes=[], start=(0, 0), goal=(1, 1))
    assert env.render() == "P___\n_G__\n____\n____\nPlayer (P) is at (0,0); goal (G) is at (1,1)."
    env = custom_env(holes=[(3, 3)], start=(0, 0), goal=(1, 1))
    assert env.coordinate_line() == "Player (P) is at (0,0); hole (O) is at (3,3); goal (G) is at (1,1)."


def test_generated_observations_follow_the_format():
    pattern = re.compile(
        r"Player( in hole \(X\)| on goal \(√\)| \(P\)) is at \(\d,\d\)"
        r"(; hole \(O\) is at \(\d,\d\)|; holes \(O\) are at \(\d,\d\)(, \(\d,\d\))+)?"
        r"(; goal \(G\) is at \(\d,\d\))?\."
    )
    env = envs.make("frozen_lake")
    rng = random.Random(5)
    for seed in range(100):
        obs, _ = env.reset(seed=seed)
        for _ in range(6):
            grid, line = obs.rsplit("\n", 1)
            assert re.fullmatch(r"([P_OGX√]{4}\n){3}[P_OGX√]{4}", grid)
            assert sum(grid.count(s) for s in "PX√") == 1
            assert pattern.fullmatch(line), line
            obs, *_ = env.step(env.sample_action(rng))


# ---- episodes ------------------------------------------------------------------------------

def test_reaching_the_goal_rewards_and_terminates():
    env = example_env()
    env.player = (2, 1)
    obs, reward, terminated, truncated, info = env.step("Left")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info == {"success": True, "action_is_valid": True, "action_is_effective": True}
    assert obs.startswith("_O__\nO___\n√___\n____\n")
    # A finished episode is absorbing: no move, no second reward.
    _, reward, terminated, _, info = env.step("Right")
    assert (reward, terminated, env.player, info["action_is_effective"]) == (0.0, True, (2, 0), False)


def test_falling_in_a_hole_terminates_without_reward():
    env = example_env()
    env.player = (1, 1)
    obs, reward, terminated, truncated, info = env.step("Left")
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert info == {"success": False, "action_is_valid": True, "action_is_effective": True}
    assert "Player in hole (X) is at (1,0)" in obs


def test_bumping_the_edge_is_ineffective_and_truncation_at_max_steps():
    env = custom_env(holes=[], start=(0, 0), goal=(3, 3), is_slippery=False, max_steps=3)
    for step in range(1, 4):
        _, reward, terminated, truncated, info = env.step("Up")
        assert (reward, terminated) == (0.0, False)
        assert truncated == (step == 3)
        assert info == {"success": False, "action_is_valid": True, "action_is_effective": False,
                        "no_effect": "the edge of the lake is in the way"}
    assert env.player == (0, 0)


def test_terminating_on_the_last_step_is_not_truncated():
    env = custom_env(holes=[], start=(3, 2), goal=(3, 3), is_slippery=False, max_steps=1)
    _, reward, terminated, truncated, _ = env.step("Right")
    assert (reward, terminated, truncated) == (1.0, True, False)


def test_unparseable_action_changes_nothing_and_is_not_counted():
    env = custom_env(holes=[], start=(1, 1), goal=(3, 3), max_steps=1)
    before = env.render()
    for text in ("jump", "", "Up Up", "1"):
        obs, reward, terminated, truncated, info = env.step(text)
        assert (obs, reward, terminated, truncated) == (before, 0.0, False, False)
        assert info == {"success": False, "action_is_valid": False, "action_is_effective": False,
                        "no_effect": "not an action"}
    assert env.steps == 0


def test_action_names_parse_and_sample():
    env = FrozenLakeEnv()
    assert env.action_names == ("Left", "Down", "Right", "Up")
    assert env.parse_action("  up ") == "Up" and env.parse_action("LEFT") == "Left"
    assert env.parse_action("north") is None
    rng = random.Random(0)
    assert {env.sample_action(rng) for _ in range(100)} == set(env.action_names)


# ---- metadata, registry, instructions ------------------------------------------------------

def test_metadata():
    assert FrozenLakeEnv.name == "frozen_lake"
    assert FrozenLakeEnv.max_actions_per_traj == 10
    assert FrozenLakeEnv.legend == {"P": "player", "_": "empty", "O": "hole", "G": "goal",
                                    "X": "player in hole", "√": "player on goal"}


def test_gymnasium_make_and_registry():
    env = gymnasium.make("spa/FrozenLake-v0")
    obs, info = env.reset(seed=3)
    assert isinstance(env.unwrapped, FrozenLakeEnv) and env.unwrapped.size == 4
    assert info["seed"] == 3 and obs == env.unwrapped.render()
    assert len(env.step("Down")) == 5
    big = envs.make("frozen_lake_6x6")
    obs, _ = big.reset(seed=0)
    assert [len(row) for row in obs.split("\n")[:6]] == [6] * 6 and len(obs.split("\n")) == 7
    assert "bottom-right corner (5, 5)" in big.instruction("world_model")
    with pytest.raises(EnvError):
        envs.make("frozen_lake", p=0)
    with pytest.raises(EnvError):
        envs.make("frozen_lake", size=1)


#: SPA's FrozenLake instructions (its config/envs.yaml), quoted exactly, typos included.
BASE_INSTRUCTION = (
    "You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to the "
    "unintended direction due to the slippery ice. Example answer format: <think>To forbid the hole and go "
    "to the target, I should go left then go up.</think><answer>Left || Up</answer>"
)
WORLD_MODEL_INSTRUCTION = (
    "You are solving the FrozenLake puzzle. You are the player and you need to Forbid the hole and go to the "
    "target. You are provided with a symbol grid and the zero-indexed coordinates of the player, each hole, "
    "and each target. Coordinates range from the top-left corner (0, 0) to the bottom-right corner (3, 3). "
    "When you are exactly next to goal, you can move in the same direction. You cannot move to a hole cause "
    "you will fall into the hole. The answer should be a sequence of actions, like <answer>Right || Right || "
    "Up</answer>. A sample full output is as follows: <think> <observation>_O__\nO___\nG___\n__P_"
    "</observation> Player (3,2); holes at (0,1) and (1,0); goal at (2,0). 1 Up - move to safe ice (2,2). "
    "2 Left - slide to (2,1), adjacent to goal. 3 Left - reach goal (2,0); player now on G. <prediction>"
    "_O__\nO___\n\u221a___\n____</prediction> </think> <answer> Up || Left || Left </answer>"
)


def test_instruction_texts_quote_spa_exactly():
    assert FrozenLakeEnv().instruction("base") == BASE_INSTRUCTION
    assert FrozenLakeEnv().instruction("world_model") == WORLD_MODEL_INSTRUCTION


def test_from_grid_puts_back_the_position_a_grid_shows():
    for seed in range(10):
        env = FrozenLakeEnv()
        env.reset(seed=seed)
        drawn = FrozenLakeEnv.from_grid(env.render_grid())
        assert (drawn.holes, drawn.goal, drawn.player, drawn.size) == (env.holes, env.goal, env.player, 4)
        assert drawn.render_grid() == env.render_grid()
    in_hole = FrozenLakeEnv.from_grid("_G__\nO___\nX___\n____")
    assert (in_hole.player, in_hole.holes, in_hole.goal) == ((2, 0), {(1, 0), (2, 0)}, (0, 1))
    assert FrozenLakeEnv.from_grid("___√\n____\n_O__\n____").player == (0, 3)
    for bad in ("_G__\nO___\n____", "_G__\nO_Q_\n____\n_P__", "____\n____\n____\n_P__"):
        with pytest.raises(EnvError, match="not a FrozenLake grid"):
            FrozenLakeEnv.from_grid(bad)
