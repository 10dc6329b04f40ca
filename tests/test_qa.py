"""QA from a local JSONL file: reading it, one question per seed, answer checking, the config route."""

from __future__ import annotations

import json
import random

import gymnasium
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import envs
from envs.base import EnvError
from envs.qa import QAEnv, answers_match, as_number, final_answer
from spa_cli.main import app
from stages.agent.env_manager import make_env
from stages.common.config import load_config
from stages.common.errors import UserError

QUESTIONS = [
    {"question": "What is 2 + 2?", "answer": "4"},
    {"question": "How many legs do 3 spiders have?", "answer": 24, "source": "ignored"},
    {"question": "Capital of France?", "answer": "Paris"},
]


def write_jsonl(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture
def questions_file(tmp_path):
    return write_jsonl(tmp_path / "questions.jsonl", [json.dumps(q) for q in QUESTIONS])


# ---- the file ----------------------------------------------------------------------------------

def test_the_file_is_read_in_order_and_blank_lines_are_skipped(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [json.dumps(QUESTIONS[0]), "", "  ", json.dumps(QUESTIONS[1])])
    env = QAEnv(path=path)
    assert [(q.question, q.answer) for q in env.questions] == [("What is 2 + 2?", "4"),
                                                               ("How many legs do 3 spiders have?", "24")]


def test_line_separators_inside_a_question_do_not_end_its_line(tmp_path):
    # valid JSON may hold U+2028, U+2029 and U+0085 unescaped (ensure_ascii=False writes them so)
    question = "Line one\u2028line two\u2029three\x85four?"
    path = write_jsonl(tmp_path / "q.jsonl", [json.dumps({"question": question, "answer": "4"}, ensure_ascii=False),
                                              json.dumps(QUESTIONS[2])])
    assert [q.question for q in QAEnv(path=path).questions] == [question, "Capital of France?"]


@pytest.mark.parametrize("bad_line, message", [
    ('{"question": "Q?", "answer": ', r"q\.jsonl:3: not JSON"),
    ('["Q?", "A"]', r'q\.jsonl:3: expected an object with a "question" text'),
    ('{"answer": "A"}', r'q\.jsonl:3: expected an object with a "question" text'),
    ('{"question": 7, "answer": "A"}', r'q\.jsonl:3: expected an object with a "question" text'),
    ('{"question": "Q?"}', r'q\.jsonl:3: "answer" must be a text or a number, got None'),
    ('{"question": "Q?", "answer": true}', r'q\.jsonl:3: "answer" must be a text or a number, got True'),
    ('{"question": "Q?", "answer": [1]}', r'q\.jsonl:3: "answer" must be a text or a number'),
])
def test_a_malformed_line_names_the_file_and_the_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "q.jsonl", [json.dumps(QUESTIONS[0]), "", bad_line])
    with pytest.raises(EnvError, match=message):
        QAEnv(path=path)


def test_missing_empty_and_unnamed_files_are_refused(tmp_path):
    with pytest.raises(EnvError, match="needs a JSONL file of questions: option path"):
        QAEnv()
    with pytest.raises(EnvError, match="cannot read the QA file"):
        QAEnv(path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(EnvError, match="holds no questions"):
        QAEnv(path=write_jsonl(tmp_path / "empty.jsonl", [""]))


# ---- episodes ----------------------------------------------------------------------------------

def test_the_seed_picks_the_question(questions_file):
    env = QAEnv(path=questions_file)
    shown = [env.reset(seed=seed)[0] for seed in (0, 1, 2, 3, 10001)]
    assert shown == ["Question: What is 2 + 2?", "Question: How many legs do 3 spiders have?",
                     "Question: Capital of France?", "Question: What is 2 + 2?",
                     "Question: Capital of France?"]


def test_a_correct_answer_wins_and_ends_the_episode(questions_file):
    env = QAEnv(path=questions_file)
    env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step(" 24 ")
    assert obs == "Question: How many legs do 3 spiders have?\nAnswer: 24 (correct)"
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info == {"success": True, "action_is_valid": True, "action_is_effective": True}
    obs2, reward, terminated, _, info = env.step("25")
    assert (obs2, reward, terminated, info["action_is_effective"]) == (obs, 0.0, True, False)


def test_a_wrong_answer_ends_the_episode(questions_file):
    env = QAEnv(path=questions_file)
    env.reset(seed=2)
    obs, reward, terminated, _, info = env.step("Lyon")
    assert obs == "Question: Capital of France?\nAnswer: Lyon (wrong)"
    assert (reward, terminated, info["success"], info["action_is_valid"]) == (0.0, True, False, True)


def test_an_empty_answer_changes_nothing(questions_file):
    env = QAEnv(path=questions_file)
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("   ")
    assert (obs, reward, terminated) == ("Question: What is 2 + 2?", 0.0, False)
    assert info == {"success": False, "action_is_valid": False, "action_is_effective": False,
                    "no_effect": "an empty answer"}
    assert env.parse_action("  ") is None and env.parse_action(" 4 ") == "4"


def test_only_the_text_render_and_the_random_policy_guesses_numbers(questions_file):
    text = QAEnv(path=questions_file)
    assert text.render_mode == "text" and text.reset(seed=0)[0] == text.render_text(coordinates=True)
    with pytest.raises(EnvError, match="qa has no render mode 'coords'; its render modes: text"):
        QAEnv(path=questions_file, render_mode="coords")
    rng = random.Random(3)
    guesses = [text.sample_action(rng) for _ in range(20)]
    assert all(0 <= int(g) <= 100 for g in guesses) and guesses == [
        text.sample_action(r) for r in [random.Random(3)] for _ in range(20)]


def test_use_before_reset_is_refused(questions_file):
    with pytest.raises(EnvError, match="reset"):
        QAEnv(path=questions_file).step("4")


# ---- answer checking ---------------------------------------------------------------------------

@pytest.mark.parametrize("given, expected", [
    ("1,000", "1000"), ("1000", "1,000.0"), ("12,345.5", "12345.50"), ("3/4", "0.75"), ("0.75", "3 / 4"),
    ("-2.5", "-5/2"), ("+7", "7"), (".5", "1/2"), ("\\boxed{42}", "42"), ("\\dfrac{1}{3}", "1/3"),
    ("The answer is \\boxed{\\frac{3}{4}}", "0.75"), ("-\\frac{1}{2}", "-0.5"), ("The answer is: 42.", "42"),
    ("$5", "5"), ("50%", "50"), ("0.3333333", "1/3"), ("2.0000001", "2"), ("Paris", "paris"),
    ("New   York", "new york"), ("x = 3", "X = 3"), ("\\boxed{x^{2}+1}", "x^{2}+1"),
])
def test_answers_that_match(given, expected):
    assert answers_match(given, expected) and answers_match(expected, given)


@pytest.mark.parametrize("given, expected", [
    ("0.333", "1/3"), ("1,00", "100"), ("4", "four"), ("24 legs", "24"), ("3/0", "0"), ("-4", "4"),
    ("1000001", "1000000"), ("\\boxed{12", "12"), ("Lyon", "Paris"), ("", "0"),
])
def test_answers_that_do_not(given, expected):
    assert not answers_match(given, expected)


def test_final_answer_and_numbers():
    assert final_answer("so \\boxed{1} or rather \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert final_answer(" The answer is 12. ") == "12"
    assert as_number("1,234,567") == 1234567 and as_number("1,23") is None and as_number("1e5") is None
    assert as_number("9" * 5000) is None  # more digits than Python converts: text, not an error


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30), st.text(max_size=30))
def test_checking_never_raises(given, expected):
    assert answers_match(given, expected) in (True, False)


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**12, 10**12))
def test_thousands_separators_and_decimals_are_the_same_number(n):
    assert answers_match(f"{n:,}", str(n)) and answers_match(f"{n}.0", f"{n:,}")


# ---- registry, config, CLI ---------------------------------------------------------------------

def test_registry_gymnasium_and_the_config_route(questions_file):
    assert envs.make("qa", path=questions_file).reset(seed=0)[0] == "Question: What is 2 + 2?"
    game = gymnasium.make("spa/QA-v0", path=questions_file)
    assert isinstance(game.unwrapped, QAEnv) and game.unwrapped.path == questions_file
    config = load_config(None, ["env.name=qa", f"env.options.path={questions_file}"])
    env = make_env(config.env, "text")
    assert isinstance(env, QAEnv) and env.path == questions_file
    with pytest.raises(UserError, match="needs a JSONL file of questions"):
        make_env(load_config(None, ["env.name=qa"]).env, "text")


def test_cli_without_a_file_or_with_a_bad_one_is_one_line(tmp_path):
    runner = CliRunner()
    out = str(tmp_path / "t.jsonl")
    text = ("--render-mode", "text")  # QA has no coordinates
    result = runner.invoke(app, ["generate", "--env", "qa", "--backend", "random", "--out", out, *text])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("error: the qa env needs a JSONL file")
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    result = runner.invoke(app, ["generate", "--env", "qa", "--backend", "random", "--out", out, *text,
                                 "--set", f"env.options.path={bad}"])
    assert result.exit_code == 2 and f"error: {bad}:1: not JSON" in result.output
