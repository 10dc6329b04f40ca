"""Fuzzing, at scale (`make test-slow`): the response parser, every registered game's action parser,
and the JSONL readers of the stages.

* `parse_response` never raises and finds exactly what SPA's regexes (with our tag tolerance)
  find, on texts built from tag fragments, separators and arbitrary characters.
* Every game's `parse_action` never raises, returns None or a non-empty action that parses to
  itself, and `step` with any text never raises and changes nothing when the text is no action.
* `read_jsonl`, the SFT reader (rows, then tokens and masks) and the cleaning of trajectories never
  fail with anything but a UserError, whatever bytes or JSON the file holds.

Each test records how many inputs it tried; the session prints the total (tests/conftest.py).
"""

from __future__ import annotations

import copy
import json
import random
import re
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs
from stages.agent.parsing import parse_response, split_actions, well_formed
from stages.clean import clean_trajectories
from stages.common import artifacts
from stages.common.config import SPAConfig
from stages.common.errors import UserError
from stages.training import sft_data

pytestmark = pytest.mark.slow


def at_scale(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


class Tried:
    """Counts the inputs a test tried and reports them (printed with -s, and to the session total)."""

    def __init__(self, record_property, what: str):
        self.count, self.record, self.what = 0, record_property, what

    def __call__(self) -> None:
        self.count += 1

    def report(self) -> None:
        self.record("fuzz_inputs", self.count)
        print(f"\n{self.what}: {self.count} inputs")


# ---- the response parser -----------------------------------------------------------------------

TAGS = ["<think>", "</think>", "<observation>", "</observation>", "<prediction>", "</prediction>", "<answer>",
        "</answer>", "< Answer >", "</ THINK>", "<  observation>", "</Prediction >", "<|im_end|>", "<|im_start|>",
        "<", ">", "/", "||", " || ", "\n", " ", "\t", "Up", "left", "1,2,3", "(1,2)"]
pieces = st.one_of(st.sampled_from(TAGS), st.text(max_size=6))
responses = st.lists(pieces, max_size=40).map("".join)


def _tag(name: str, closing: bool = False) -> str:
    return rf"<\s*{'/' if closing else ''}\s*{name}\s*>"


FLAGS = re.DOTALL | re.IGNORECASE
# SPA's two regexes, with the tolerance our parser documents (inner whitespace, any case).
WORLD_MODEL = re.compile(
    rf"{_tag('think')}\s*{_tag('observation')}(.*?){_tag('observation', True)}(.*?){_tag('prediction')}(.*?)"
    rf"{_tag('prediction', True)}\s*{_tag('think', True)}\s*{_tag('answer')}(.*?){_tag('answer', True)}", FLAGS)
BASE = re.compile(rf"{_tag('think')}(.*?){_tag('think', True)}\s*{_tag('answer')}(.*?){_tag('answer', True)}",
                  FLAGS)
SPECIAL = re.compile(r"<\s*/?\s*(?:think|observation|prediction|answer)\s*>|<\|im_start\|>|<\|im_end\|>",
                     re.IGNORECASE)


def cleaned(group: str) -> str:
    return SPECIAL.sub("", group).strip()


def inner(text: str, name: str) -> str | None:
    match = re.search(f"{_tag(name)}(.*?){_tag(name, True)}", text, FLAGS)
    return cleaned(match.group(1)) if match else None


def expected(completion: str, mode: str, max_actions: int) -> tuple:
    """What SPA's regex finds, as (format_ok, observation, prediction, thoughts, answer, actions)."""
    text = "<think>" + completion
    if mode == "world_model":
        match = WORLD_MODEL.search(text)
        if match is None:
            return (False, None, None, None, None, [])
        observation, thoughts, prediction, answer = map(cleaned, match.groups())
    else:
        match = BASE.search(text)
        if match is None:
            return (False, None, None, None, None, [])
        thoughts, answer = cleaned(match.group(1)), cleaned(match.group(2))
        observation, prediction = inner(match.group(1), "observation"), inner(match.group(1), "prediction")
    return (True, observation, prediction, thoughts, answer, split_actions(answer, max_actions))


def test_the_response_parser_finds_what_spas_regex_finds(record_property):
    tried = Tried(record_property, "parse_response and well_formed")

    @at_scale(30_000)
    @given(responses, st.sampled_from(["world_model", "base"]), st.integers(0, 6))
    def check(completion, mode, max_actions):
        tried()
        parsed = parse_response(completion, mode, max_actions)
        got = (parsed.format_ok, parsed.observation, parsed.prediction, parsed.thoughts, parsed.answer,
               parsed.actions)
        assert got == expected(completion, mode, max_actions)
        assert len(parsed.actions) <= max_actions
        assert all(action and action == action.strip() and "||" not in action for action in parsed.actions)
        assert isinstance(well_formed(completion, mode), bool)

    check()
    tried.report()


# ---- the games' action parsers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def games(tmp_path_factory) -> dict[str, envs.TextGameEnv]:
    """Every registered game, built with the options it needs (qa: a file of questions)."""
    questions = tmp_path_factory.mktemp("qa") / "questions.jsonl"
    questions.write_text('{"question": "What is 6 x 7?", "answer": 42}\n{"question": "Capital of France?", '
                         '"answer": "Paris"}\n')
    options = {"qa": {"path": str(questions)}}
    return {name: envs.make(name, **options.get(name, {})) for name in envs.names()}


def action_like(game: envs.TextGameEnv) -> st.SearchStrategy[str]:
    """Texts near the game's actions: its names in any case, its sampled moves, digits, operators."""
    rng = random.Random(0)
    game.reset(seed=0)
    samples = [game.sample_action(rng) for _ in range(30)] + list(game.action_names or ())
    words = samples + [s.upper() for s in samples] + [s.lower() for s in samples]
    symbols = list(string.digits + "+-*/()=,.;: \t\n") + ["||", "√", "\u00a0", "\x00", "1e9", "-0", "٣"]
    part = st.one_of(st.sampled_from(words), st.sampled_from(symbols), st.text(max_size=5))
    return st.lists(part, max_size=12).map("".join)


def test_every_games_action_parser_is_total_and_canonical(games, record_property):
    tried = Tried(record_property, f"parse_action and step of {len(games)} games")
    for name, game in games.items():
        fuzz_one_game(name, game, tried)
    tried.report()


def fuzz_one_game(name: str, game: envs.TextGameEnv, tried: Tried) -> None:
    @at_scale(4_000)
    @given(action_like(game), st.integers(0, 10**6))
    def check(text, seed):
        tried()
        action = game.parse_action(text)
        assert action is None or (isinstance(action, str) and action), (name, text, action)
        if action is not None:
            assert game.parse_action(action) == action, (name, text, action)
        state, _ = game.reset(seed=seed % 50)
        after, _, _, _, info = game.step(text)
        if action is None:
            assert not info["action_is_valid"] and after == state, (name, text)

    check()


# ---- the JSONL readers ------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner_values: st.lists(inner_values, max_size=4) | st.dictionaries(st.text(max_size=8), inner_values,
                                                                              max_size=4),
    max_leaves=12)
messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool", "wizard", ""]) | json_values,
    "content": st.text(max_size=30) | st.sampled_from(TAGS) | json_values,
}, optional={"train": st.booleans() | json_values}), max_size=5)
turns = st.lists(st.fixed_dictionaries({}, optional={
    "state": st.text(max_size=20) | json_values, "next_state": st.text(max_size=20) | json_values}), max_size=4)
rows = st.fixed_dictionaries(
    {"id": st.text(max_size=8) | json_values, "messages": messages | json_values, "turns": turns | json_values},
    optional={"env": st.sampled_from(["sokoban", "sudoku"]) | json_values, "success": json_values,
              "prompt_mode": st.sampled_from(["world_model", "base"]) | json_values, "source_id": json_values})
lines = st.one_of(rows.map(json.dumps), json_values.map(json.dumps), st.text(max_size=30),
                  rows.map(lambda row: json.dumps(row)[: len(json.dumps(row)) // 2]))
files = st.one_of(st.lists(lines, max_size=6).map(lambda ls: "\n".join(ls).encode()), st.binary(max_size=200))


def test_read_jsonl_returns_rows_or_says_why(tmp_path, record_property):
    tried = Tried(record_property, "read_jsonl")
    path = tmp_path / "data.jsonl"

    @at_scale(10_000)
    @given(files, st.booleans(), st.sampled_from([(), ("id",), ("id", "messages", "turns")]))
    def check(data, skip_bad, required):
        tried()
        path.write_bytes(data)
        try:
            found, bad = artifacts.read_jsonl(path, skip_bad=skip_bad, required=required)
        except UserError:
            return
        assert all(isinstance(row, dict) and all(key in row for key in required) for row in found)
        with path.open(encoding="utf-8") as handle:  # lines as a text file has them (\n, \r, \r\n)
            filled = [line for line in handle if line.strip()]
        assert len(found) + bad == len(filled)
        assert skip_bad or bad == 0

    check()
    tried.report()


def test_the_sft_reader_takes_rows_or_says_why(tmp_path, record_property):
    from stages.common.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    tried = Tried(record_property, "sft read_rows + tokenize_rows")
    path = tmp_path / "sft.jsonl"

    @at_scale(2_000)
    @given(st.lists(lines, min_size=1, max_size=4), st.sampled_from(sft_data.STATE_TEXT))
    def check(file_lines, state_text):
        tried()
        path.write_text("\n".join(file_lines) + "\n")
        try:
            found = sft_data.read_rows(path)
            examples, stats = sft_data.tokenize_rows(found, tokenizer, 512, state_text)
        except UserError:
            return
        assert stats.kept == len(examples) and all(len(ex.mask) == len(ex.input_ids) <= 512 for ex in examples)
        assert all(ex.trained > 0 for ex in examples)

    check()
    tried.report()


@pytest.fixture(scope="module")
def played() -> list[dict]:
    """Real trajectories of three games, played by the random backend."""
    from stages.agent.backends.random import RandomBackend
    from stages.agent.proxy import play

    found = []
    for env in ("sokoban", "frozen_lake", "sudoku"):
        config = SPAConfig()
        config.env.name, config.rollout.max_turns = env, 3
        found += [episode.to_json() for episode in play(config.env, config.rollout, RandomBackend("world_model"),
                                                        [1, 2], 2, prompt_mode="world_model", render_mode="coords")]
    return found


MUTABLE = ["id", "messages", "turns", "env", "prompt_mode", "success", "turns.0.state", "turns.-1.next_state",
           "messages.2.content", "messages.-1.role", "turns.0", "messages.0"]


def mutated(row: dict, where: str, value: object) -> dict:
    """`row` with the value at `where` (a dotted path; list indices may be negative) replaced."""
    row = copy.deepcopy(row)
    *parents, last = where.split(".")
    node = row
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return row


def test_cleaning_takes_any_trajectory_rows(played, record_property):
    tried = Tried(record_property, "clean_trajectories")
    real = st.sampled_from(played)
    broken = st.builds(mutated, real, st.sampled_from(MUTABLE), json_values | st.sampled_from(TAGS))

    @at_scale(5_000)
    @given(st.lists(st.one_of(rows, real, broken), max_size=5), st.sampled_from(["trajectory", "turn"]),
           st.booleans(), st.sampled_from(["ground_truth", "self_belief"]))
    def check(trajectories, unit, random_coordinates, states):
        tried()
        config = SPAConfig()
        config.clean.unit, config.clean.states = unit, states
        config.clean.random_coordinates = random_coordinates and states == "ground_truth"
        result = clean_trajectories(trajectories, config)
        kept = result.train + result.val
        assert all(isinstance(row["messages"], list) and isinstance(row["source_id"], str) for row in kept)
        if all(trajectory in played for trajectory in trajectories):
            assert result.dropped_trajectories["malformed"] == 0

    check()
    tried.report()
