"""Countdown: the equation parser, exact arithmetic, one-answer episodes, puzzles and their solutions."""

from __future__ import annotations

import random
from fractions import Fraction
from functools import cache
from itertools import combinations

import gymnasium
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs
from envs.base import EnvError
from envs.countdown import CountdownEnv, parse_equation, random_expression
from stages.agent import prompts


def puzzle(numbers=(3, 5, 8, 1), target=24) -> CountdownEnv:
    env = CountdownEnv()
    env.load_puzzle(list(numbers), target)
    return env


# ---- the parser --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, canonical, value", [
    ("(25 - 5) * 3 + 4", "(25 - 5) * 3 + 4", 64),
    ("(25-5)*3+4", "(25 - 5) * 3 + 4", 64),
    ("  8 *(5-3 +1) ", "8 * (5 - 3 + 1)", 24),
    ("(5 - 3 + 1) * 8 = 24", "(5 - 3 + 1) * 8", 24),
    ("(5 - 3 + 1) * 8 = 25", "(5 - 3 + 1) * 8", 24),  # the claimed result is ignored
    ("3 × 4 ÷ 2", "3 * 4 / 2", 6),
    ("7 / 2 * 2", "7 / 2 * 2", 7),  # exact: no rounding of 7/2
    ("1 / 3 + 1 / 3 + 1 / 3", "1 / 3 + 1 / 3 + 1 / 3", 1),
    ("8 - 3 - 5", "8 - 3 - 5", 0),  # left to right
    ("8 / 4 / 2", "8 / 4 / 2", 1),
    ("2 + 3 * 4", "2 + 3 * 4", 14),  # * before +
    ("((7))", "((7))", 7),
    ("1 - 8", "1 - 8", -7),
    ("3 / 8", "3 / 8", Fraction(3, 8)),
    ("007", "007", 7),
])
def test_equations_parse_to_their_exact_value(text, canonical, value):
    equation = parse_equation(text)
    assert (equation.text, equation.value) == (canonical, value)
    assert CountdownEnv().parse_action(text) == canonical


@pytest.mark.parametrize("text", [
    "", "   ", "24 = ", "= 24", "1 +", "* 3", "(1 + 2", "1 + 2)", "()", "3 4", "-3 + 4", "2.5 * 2",
    "2 ^ 3", "2 ** 3", "x + 1", "5 / 0", "5 / (3 - 3)", "1 = 2 = 3", "1 + 1 = x", "1 + 1 = 2 + 0",
    "1234567890 + 1", "(" * 33 + "1" + ")" * 33, "__import__('os')", "²", "1 || 2",
])
def test_what_is_not_an_equation_is_none(text):
    assert parse_equation(text) is None
    assert CountdownEnv().parse_action(text) is None


def test_limits_are_inclusive():
    assert parse_equation("123456789 * 2").value == 246913578
    assert parse_equation("(" * 32 + "1" + ")" * 32).value == 1


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("0123456789+-*/×÷()= x.^"), max_size=40) | st.text(max_size=40))
def test_the_parser_never_raises(text):
    equation = parse_equation(text)
    assert equation is None or parse_equation(equation.text) == equation  # canonical text is stable
    env = puzzle()
    obs, reward, *_ = env.step(text)
    assert reward in (0.0, 1.0) and obs.startswith("Target: 24; numbers: 3, 5, 8, 1")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=6), st.integers(0, 2**32))
def test_random_expressions_parse_back_to_their_value(numbers, seed):
    for whole in (True, False):
        text, value = random_expression(random.Random(seed), numbers, whole)
        equation = parse_equation(text)
        assert equation is not None and equation.value == value
        assert sorted(equation.numbers) == sorted(numbers)
        if whole:
            assert value.denominator == 1 and value > 0


# ---- episodes ----------------------------------------------------------------------------------

def test_a_correct_equation_wins_and_ends_the_episode():
    env = puzzle()
    assert env.render() == "Target: 24; numbers: 3, 5, 8, 1"
    obs, reward, terminated, truncated, info = env.step("(5 - 3 + 1) * 8")
    assert obs == "Target: 24; numbers: 3, 5, 8, 1; equation: (5 - 3 + 1) * 8 = 24"
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info == {"success": True, "action_is_valid": True, "action_is_effective": True}
    # the answer is final
    obs2, reward, terminated, _, info = env.step("3 + 5")
    assert (obs2, reward, terminated) == (obs, 0.0, True)
    assert info == {"success": True, "action_is_valid": True, "action_is_effective": False,
                    "no_effect": "the answer is already given"}


def test_not_every_number_has_to_be_used():
    _, reward, _, _, info = puzzle((4, 6, 9, 2), 24).step("4 * 6")
    assert reward == 1.0 and info["success"]


@pytest.mark.parametrize("answer, shown", [
    ("3 + 5", "3 + 5 = 8"),
    ("3 / 8", "3 / 8 = 3/8"),
    ("1 - 8", "1 - 8 = -7"),
    ("8 * 3 = 24", "8 * 3 = 24"),
])
def test_a_wrong_equation_ends_the_episode_with_its_value_shown(answer, shown):
    env = puzzle(target=23)
    obs, reward, terminated, truncated, info = env.step(answer)
    assert obs == f"Target: 23; numbers: 3, 5, 8, 1; equation: {shown}"
    assert (reward, terminated, truncated, info["success"], info["action_is_valid"]) == (0.0, True, False,
                                                                                          False, True)


@pytest.mark.parametrize("answer", [
    "8 * 3 * 1 * 1",  # 1 is given once
    "24",  # not given
    "twenty-four",  # not an equation
    "8 * 3 / (1 - 1)",  # division by zero
    "",
])
def test_answers_that_break_the_rules_change_nothing(answer):
    env = puzzle()
    obs, reward, terminated, truncated, info = env.step(answer)
    assert (obs, reward, terminated, truncated) == ("Target: 24; numbers: 3, 5, 8, 1", 0.0, False, False)
    assert info == {"success": False, "action_is_valid": False, "action_is_effective": False,
                    "no_effect": "not an equation over the given numbers"}
    assert env.step("8 * 3")[1] == 1.0  # a later valid answer still counts


def test_repeated_numbers_may_each_be_used_once():
    env = puzzle((6, 6, 2, 9), 24)
    assert env.step("6 * 6 - 2 * 9 + 6")[4]["action_is_valid"] is False
    _, reward, _, _, info = env.step("(6 + 6) * 2")
    assert reward == 1.0 and info["action_is_valid"]


def test_no_coordinates_so_only_the_text_render():
    text = CountdownEnv()
    assert text.render_mode == "text"
    assert text.reset(seed=3)[0] == text.render_text(coordinates=True) == text.render_text(coordinates=False)
    assert "\n" not in text.render()
    with pytest.raises(EnvError, match="countdown has no render mode 'coords'; its render modes: text"):
        CountdownEnv(render_mode="coords")


def test_use_before_reset_is_refused():
    with pytest.raises(EnvError, match="reset"):
        CountdownEnv().step("1 + 1")


# ---- puzzles -----------------------------------------------------------------------------------

@cache
def reachable(values: tuple[Fraction, ...]) -> frozenset[Fraction]:
    """Every value of an expression using each of `values` at most once (brute force)."""
    found = set(values)
    for i, j in combinations(range(len(values)), 2):
        a, b = values[i], values[j]
        rest = tuple(v for k, v in enumerate(values) if k not in (i, j))
        results = {a + b, a - b, b - a, a * b} | ({a / b} if b else set()) | ({b / a} if a else set())
        for result in results:
            found |= reachable(tuple(sorted((*rest, result))))
    return frozenset(found)


def test_the_brute_force_solver_is_right_on_known_puzzles():
    assert 24 in reachable((1, 3, 5, 8)) and 24 in reachable((1, 5, 5, 5))  # (5 - 1/5) * 5
    assert 24 not in reachable((1, 1, 1, 1)) and 7 not in reachable((1, 1))


def test_every_puzzle_is_solvable_and_within_its_ranges():
    env = CountdownEnv()
    for seed in range(300):
        text, _ = env.reset(seed=seed)
        assert len(env.numbers) == 4 and all(1 <= n <= 20 for n in env.numbers)
        assert 1 <= env.target <= 100
        assert text == f"Target: {env.target}; numbers: {', '.join(map(str, env.numbers))}"
        assert env.target in reachable(tuple(sorted(map(Fraction, env.numbers)))), f"seed {seed}"


def test_other_sizes_are_solvable_too():
    env = CountdownEnv(count=3, max_number=50, max_target=500)
    for seed in range(50):
        env.reset(seed=seed)
        assert len(env.numbers) == 3 and max(env.numbers) <= 50 and 1 <= env.target <= 500
        assert env.target in reachable(tuple(sorted(map(Fraction, env.numbers))))


def test_seeds_are_reproducible_and_pinned():
    env = CountdownEnv()
    first = [env.reset(seed=s)[0] for s in range(30)]
    assert first == [CountdownEnv().reset(seed=s)[0] for s in range(30)]
    assert len(set(first)) == 30
    assert first[0] == "Target: 25; numbers: 4, 20, 9, 18"


def test_the_random_policy_writes_valid_answers():
    env = CountdownEnv()
    rng = random.Random(0)
    for seed in range(100):
        env.reset(seed=seed)
        answer = env.sample_action(rng)
        assert env.parse_action(answer) == answer
        assert env.step(answer)[4]["action_is_valid"] is True


@pytest.mark.parametrize("options", [{"count": 1}, {"max_number": 0}, {"max_target": 0}])
def test_bad_options_are_refused(options):
    with pytest.raises(EnvError):
        CountdownEnv(**options)


# ---- prompt, registry ----------------------------------------------------------------------------

def test_the_instruction_sample_is_what_the_env_shows():
    text = CountdownEnv().instruction("world_model")
    env = puzzle()
    observation, prediction = env.render(), env.step("(5 - 3 + 1) * 8")[0]
    assert f"<observation>{observation}</observation>" in text
    assert f"<prediction>{prediction}</prediction>" in text
    assert "<answer>(5 - 3 + 1) * 8</answer>" in CountdownEnv().instruction("base")


def test_the_prompt_has_no_legend_and_no_action_list():
    env = CountdownEnv()
    assert prompts.instruction_prefix(env, "base", 1) == env.instruction("base")
    assert (env.action_names, env.legend, env.max_actions_per_traj) == (None, None, 1)


def test_registry_and_gymnasium():
    assert envs.make("countdown").reset(seed=0)[0] == "Target: 25; numbers: 4, 20, 9, 18"
    game = gymnasium.make("spa/Countdown-v0", count=3)
    assert isinstance(game.unwrapped, CountdownEnv) and game.unwrapped.count == 3
