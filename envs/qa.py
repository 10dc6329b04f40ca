"""Question answering from a local JSONL file, one question per episode (SPA's MetaMathQA setting).

Data
----
* Option ``path`` (required; in a config ``env.options: {path: data/questions.jsonl}``): a JSONL
  file, one ``{"question": "...", "answer": ...}`` object a line (the answer a string or a number;
  other keys are ignored, blank lines skipped). The file is read when the env is built; a line that
  is not such an object is an ``EnvError`` naming the file and the line number. Nothing is
  downloaded: bring your own file (for MetaMathQA, its ``query`` and the final answer after "The
  answer is: " in its ``response``).
* ``reset(seed=s)`` asks question number ``s mod N`` (N questions, counted from 0 in file order),
  so consecutive seeds walk through the file. Train seeds start at 10000 and eval seeds at 123, so
  give eval a file of its own (``--set env.options.path=...``) rather than the training file.

Answers
-------
* Any non-empty text is an answer (``parse_action`` returns it stripped); empty text is not, and
  changes nothing, with ``action_is_valid=False``.
* The final answer is taken from both sides alike: the content of the last ``\\boxed{...}`` if
  there is one, else the text after a leading "The answer is" (with or without ":"), without
  ``$`` signs and a trailing ".".
* When both sides read as numbers they are compared as numbers: whole numbers exactly, others
  with a relative tolerance of 1e-6 (absolute 1e-9 near zero), so ``0.3333333`` is ``1/3`` but
  ``1000001`` is not ``1000000``. A number is an optional sign and digits with an optional decimal
  part (``-2.5``, ``.5``), thousands may be grouped by commas (``1,000``, ``12,345.5``), or a
  fraction ``3/4``, ``-3/4`` or ``\\frac{3}{4}`` (also ``\\dfrac``, ``\\tfrac``), or a
  percentage ``50%`` (= 50, as MATH-style answers write it).
* Otherwise they are compared as text, case-folded, with runs of whitespace made one space.
* The first answer ends the episode: reward 1 and ``success`` when it is correct, else 0. Later
  steps change nothing and give reward 0. ``max_actions_per_traj`` is 1.

State text
----------
``Question: <question>``; after the answer, a line is added: ``Answer: <answer> (correct)`` or
``Answer: <answer> (wrong)``, which is what the world model's ``<prediction>`` has to foresee.
There are no coordinates, so the only render mode is "text".
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import ClassVar

from envs.base import EnvError, TextGameEnv

# Exact fractions, so huge numbers compare without float overflow.
RELATIVE_TOLERANCE = Fraction(1, 10**6)
ABSOLUTE_TOLERANCE = Fraction(1, 10**9)

_NUMBER = r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?"
_PLAIN = re.compile(rf"({_NUMBER})(%?)")
_FRACTION = re.compile(rf"({_NUMBER})\s*/\s*({_NUMBER})")
_LATEX_FRACTION = re.compile(r"([+-]?)\\[dt]?frac\{\s*(" + _NUMBER + r")\s*\}\{\s*(" + _NUMBER + r")\s*\}")
_ANSWER_PREFIX = re.compile(r"^the answer is\s*:?\s*", re.IGNORECASE)

_TASK = (
    "You are answering a question. Work it out, then give only the final answer (a number or a short "
    "expression) inside the answer tags, like <answer>42</answer>."
)
INSTRUCTIONS = {
    "base": _TASK,
    "world_model": _TASK + " The state shows the question; after your answer it also shows your answer "
    "and whether it is correct. A sample full output is as follows: <think> <observation>Question: Tom "
    "has 3 boxes of 12 pencils and gives away 5 pencils. How many pencils does he have left?"
    "</observation> 3 * 12 = 36 pencils, 36 - 5 = 31. <prediction>Question: Tom has 3 boxes of 12 "
    "pencils and gives away 5 pencils. How many pencils does he have left?\nAnswer: 31 (correct)"
    "</prediction> </think> <answer> 31 </answer>",
}


@dataclass(frozen=True)
class Question:
    question: str
    answer: str


def read_questions(path: str | Path) -> list[Question]:
    """Every question of the JSONL file; a malformed line is an EnvError naming file and line."""
    try:
        # split on newlines only: JSON strings may hold U+2028, U+0085 or a form feed unescaped,
        # which str.splitlines would take for line ends
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as err:
        raise EnvError(f"cannot read the QA file {path}: {err}") from None
    questions = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise EnvError(f"{path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise EnvError(f'{path}:{number}: expected an object with a "question" text and an "answer"')
        answer = row.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise EnvError(f'{path}:{number}: "answer" must be a text or a number, got {answer!r}')
        questions.append(Question(row["question"], str(answer)))
    if not questions:
        raise EnvError(f"the QA file {path} holds no questions")
    return questions


# ---- answer checking ---------------------------------------------------------------------------


def final_answer(text: str) -> str:
    """The answer part of `text`: the last \\boxed{...}, else the text after "The answer is"."""
    boxed = _last_boxed(text)
    text = boxed if boxed is not None else _ANSWER_PREFIX.sub("", text.strip())
    return text.replace("$", "").strip().removesuffix(".").strip()


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def as_number(text: str) -> Fraction | None:
    """The number `text` writes (see the module docstring), or None."""
    text = text.strip()
    if match := _LATEX_FRACTION.fullmatch(text):
        sign, top, bottom = match.groups()
        return _ratio(sign + top, bottom)
    if match := _FRACTION.fullmatch(text):
        return _ratio(*match.groups())
    if match := _PLAIN.fullmatch(text):
        return _decimal(match.group(1))
    return None


def _decimal(text: str) -> Fraction | None:
    digits = text.replace(",", "")
    if not any(c.isdigit() for c in digits):
        return None
    try:
        return Fraction(digits)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        return None


def _ratio(top: str, bottom: str) -> Fraction | None:
    numerator, denominator = _decimal(top), _decimal(bottom)
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def answers_match(given: str, expected: str) -> bool:
    """Whether the answer `given` is the `expected` one (see the module docstring)."""
    given, expected = final_answer(given), final_answer(expected)
    given_number, expected_number = as_number(given), as_number(expected)
    if given_number is not None and expected_number is not None:
        if given_number.denominator == expected_number.denominator == 1:
            return given_number == expected_number
        scale = max(abs(given_number), abs(expected_number))
        return abs(given_number - expected_number) <= max(RELATIVE_TOLERANCE * scale, ABSOLUTE_TOLERANCE)
    return " ".join(given.casefold().split()) == " ".join(expected.casefold().split())


# ---- the game ----------------------------------------------------------------------------------


class QAEnv(TextGameEnv):
    """One question from a JSONL file per episode; see the module docstring."""

    name: ClassVar[str] = "qa"
    action_names: ClassVar[None] = None
    move_format: ClassVar[str] = "the final answer"
    legend: ClassVar[None] = None
    # No coordinates: the state text is the same either way, so only "text" is offered.
    metadata: ClassVar[dict] = {"render_modes": ["text"]}
    instructions: ClassVar[dict[str, str]] = INSTRUCTIONS
    max_actions_per_traj: ClassVar[int] = 1

    def __init__(self, path: str | None = None, render_mode: str = "text"):
        super().__init__(render_mode=render_mode)
        if path is None:
            raise EnvError("the qa env needs a JSONL file of questions: option path "
                           "(--set env.options.path=FILE)")
        self.path = str(path)
        self.questions = read_questions(self.path)
        self.current: Question | None = None
        self.answer: str | None = None

    @property
    def solved(self) -> bool:
        return self.answer is not None and answers_match(self.answer, self._require_question().answer)

    def _reset(self, rng: random.Random) -> None:
        self.current = self.questions[self._seed % len(self.questions)]
        self.answer = None

    def parse_action(self, text: str) -> str | None:
        return text.strip() or None

    def sample_action(self, rng: random.Random) -> str:
        """A random whole number from 0 to 100 (a guess; QA has no space of moves to draw from)."""
        return str(rng.randint(0, 100))

    def _step(self, action: str) -> tuple[float, bool, bool, dict]:
        self._require_question()
        answer = self.parse_action(action)
        if self.answer is not None:  # the first answer is final
            return 0.0, True, False, self._info(valid=answer is not None, effective=False,
                                                no_effect="the question is already answered")
        if answer is None:
            return 0.0, False, False, self._info(valid=False, effective=False, no_effect="an empty answer")
        self.answer = answer
        return float(self.solved), True, False, self._info(valid=True, effective=True)

    def render_grid(self) -> str:
        text = f"Question: {self._require_question().question}"
        if self.answer is not None:
            text += f"\nAnswer: {self.answer} ({'correct' if self.solved else 'wrong'})"
        return text

    def coordinate_line(self) -> str:
        return ""

    def _info(self, valid: bool, effective: bool, no_effect: str = "") -> dict:
        info = {"success": self.solved, "action_is_valid": valid, "action_is_effective": effective}
        return info | ({"no_effect": no_effect} if no_effect else {})

    def _require_question(self) -> Question:
        if self.current is None:
            raise EnvError("call reset() before using the qa env")
        return self.current
