"""Countdown as a one-answer text game: reach the target number from the given numbers.

Puzzle
------
* ``count`` numbers (default 4) are drawn uniformly, with repetition, from 1..``max_number``
  (default 20).
* The target is the value of a random expression over *all* the drawn numbers: two of the values
  left are combined, in random order, by a random operation among those that keep the result a
  positive whole number (``+`` and ``*`` always, ``-`` when the first is larger, ``/`` when it
  divides exactly), until one value is left. A target outside 1..``max_target`` (default 100)
  is thrown away and numbers and expression are drawn again. So every puzzle has a solution that
  uses each number once.
* All randomness comes from the ``random.Random(seed)`` given to ``reset``.

Answers
-------
* An answer is one equation: whole numbers, ``+ - * /`` (``×`` and ``÷`` are read as ``*`` and
  ``/``), parentheses and spaces, optionally followed by ``= N`` with N a whole number. The
  ``= N`` suffix is accepted and ignored: only the left side is judged. Not accepted: unary minus,
  decimals, other operators, a number longer than 9 digits, parentheses nested deeper than 32.
* Arithmetic is exact (``fractions.Fraction``), so ``7 / 2 * 2`` is 7, and intermediate results
  may be negative or fractional. The text is read by a small tokenizer and recursive-descent
  parser; nothing is evaluated as Python.
* ``parse_action`` gives the canonical equation (single spaces around operators, parentheses as
  written, the suffix dropped), or None when the text is not an equation or divides by zero.
* ``step``: text that is not an equation, or one that uses a number not given (or more often
  than given; each given number may be used at most once, not every number must be used),
  changes nothing, gives reward 0 and ``action_is_valid=False``. Otherwise the answer is final:
  the episode terminates with reward 1 and ``success`` when the equation's value is the target,
  reward 0 otherwise. Later steps change nothing and give reward 0.
* ``max_actions_per_traj`` is 1: the agent loop plays one answer per episode.

State text
----------
One line; there are no coordinates, so the only render mode is "text"::

    Target: 24; numbers: 3, 5, 8, 1

After the answer, the equation and the value it has (a whole number, or ``a/b``) are appended,
so the world model's ``<prediction>`` is the value its own equation gives::

    Target: 24; numbers: 3, 5, 8, 1; equation: (5 - 3 + 1) * 8 = 24
"""

from __future__ import annotations

import operator
import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

from envs.base import EnvError, TextGameEnv

MAX_ATTEMPTS = 1000
MAX_DIGITS = 9
MAX_DEPTH = 32
# Written operator -> the one it means; the canonical text uses the ASCII ones.
OPERATORS = {"+": "+", "-": "-", "*": "*", "/": "/", "×": "*", "÷": "/"}
APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
ATOM = 3  # the precedence of a number or a parenthesised expression

_TASK = (
    "You are solving the Countdown puzzle. Combine the given numbers with +, -, *, / and parentheses to "
    "reach the target number; each number may be used at most once. The answer should be one equation, "
    "like <answer>(5 - 3 + 1) * 8</answer>."
)
INSTRUCTIONS = {
    "base": _TASK,
    "world_model": _TASK + " The state shows the target and the numbers; after your answer it also shows "
    "your equation and the value it gives. A sample full output is as follows: <think> <observation>"
    "Target: 24; numbers: 3, 5, 8, 1</observation> 5 - 3 = 2, 2 + 1 = 3, 3 * 8 = 24. <prediction>"
    "Target: 24; numbers: 3, 5, 8, 1; equation: (5 - 3 + 1) * 8 = 24</prediction> </think> <answer> "
    "(5 - 3 + 1) * 8 </answer>",
}


# ---- equations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Equation:
    text: str  # canonical: "(5 - 3 + 1) * 8"
    value: Fraction
    numbers: tuple[int, ...]  # the numbers it uses, in order of appearance


class _NotAnEquation(Exception):
    """Raised inside the parser; `parse_equation` turns it into None."""


def tokenize(text: str) -> list[str]:
    """Numbers, operators (as ASCII), parentheses and "="; anything else is not an equation."""
    tokens, i = [], 0
    while i < len(text):
        char = text[i]
        if char in "0123456789":
            start = i
            while i < len(text) and text[i] in "0123456789":
                i += 1
            tokens.append(text[start:i])
            continue
        if char in OPERATORS:
            tokens.append(OPERATORS[char])
        elif char in "()=":
            tokens.append(char)
        elif not char.isspace():
            raise _NotAnEquation
        i += 1
    return tokens


class _Parser:
    """expression := term (("+" | "-") term)*;  term := factor (("*" | "/") factor)*;
    factor := number | "(" expression ")". Values are exact fractions."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.position = tokens, 0
        self.numbers: list[int] = []

    def parse(self) -> Fraction:
        value = self.expression(0)
        if self.position != len(self.tokens):
            raise _NotAnEquation
        return value

    def expression(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            sign = self.take()
            value = APPLY[sign](value, self.term(depth))
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            symbol, right = self.take(), self.factor(depth)
            if symbol == "/" and right == 0:
                raise _NotAnEquation
            value = APPLY[symbol](value, right)
        return value

    def factor(self, depth: int) -> Fraction:
        token = self.take()
        if token == "(" and depth < MAX_DEPTH:
            value = self.expression(depth + 1)
            if self.take() != ")":
                raise _NotAnEquation
            return value
        if token is not None and token.isdigit() and len(token) <= MAX_DIGITS:
            self.numbers.append(int(token))
            return Fraction(int(token))
        raise _NotAnEquation

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str | None:
        token = self.peek()
        self.position += 1
        return token


def parse_equation(text: str) -> Equation | None:
    """The equation written in `text` (see the module docstring), or None if it is not one."""
    try:
        tokens = tokenize(text)
        if "=" in tokens:
            cut = tokens.index("=")
            claimed = tokens[cut + 1:]
            if len(claimed) != 1 or not claimed[0].isdigit():
                raise _NotAnEquation
            tokens = tokens[:cut]
        parser = _Parser(tokens)
        value = parser.parse()
    except _NotAnEquation:
        return None
    text = "".join(f" {token} " if token in PRECEDENCE else token for token in tokens)
    return Equation(text, value, tuple(parser.numbers))


# ---- puzzles -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Term:
    value: Fraction
    text: str
    precedence: int


def _combine(left: _Term, symbol: str, right: _Term) -> _Term:
    """`left symbol right` with the fewest parentheses that keep its meaning."""
    precedence = PRECEDENCE[symbol]
    left_text = f"({left.text})" if left.precedence < precedence else left.text
    # a - (b + c) and a / (b * c) need them on the right even at equal precedence
    wrap_right = right.precedence < precedence or (right.precedence == precedence and symbol in "-/")
    right_text = f"({right.text})" if wrap_right else right.text
    return _Term(APPLY[symbol](left.value, right.value), f"{left_text} {symbol} {right_text}", precedence)


def random_expression(rng: random.Random, numbers: list[int], whole: bool) -> tuple[str, Fraction]:
    """A random expression using each of `numbers` once, as (text, value).

    With `whole`, every intermediate result is a positive whole number (how targets are built);
    without it any of the four operations may be drawn, except a division by zero.
    """
    terms = [_Term(Fraction(n), str(n), ATOM) for n in numbers]
    while len(terms) > 1:
        i, j = rng.sample(range(len(terms)), 2)
        left, right = terms[i], terms[j]
        if whole:
            allowed = ["+", "*"] + ["-"] * (left.value > right.value)
            allowed += ["/"] * (left.value % right.value == 0)
        else:
            allowed = ["+", "-", "*"] + ["/"] * (right.value != 0)
        combined = _combine(left, rng.choice(allowed), right)
        terms = [term for k, term in enumerate(terms) if k not in (i, j)] + [combined]
    return terms[0].text, terms[0].value


def generate_puzzle(rng: random.Random, count: int, max_number: int,
                    max_target: int) -> tuple[list[int], int]:
    """(numbers, target) with a target reachable from the numbers (see the module docstring)."""
    for _ in range(MAX_ATTEMPTS):
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        _, target = random_expression(rng, numbers, whole=True)
        if target <= max_target:
            return numbers, int(target)
    raise EnvError(f"no Countdown puzzle with {count} numbers up to {max_number} and a target up to "
                   f"{max_target} in {MAX_ATTEMPTS} attempts; raise max_target")


# ---- the game ----------------------------------------------------------------------------------


class CountdownEnv(TextGameEnv):
    """Countdown; see the module docstring for puzzles, answers and the state text."""

    name: ClassVar[str] = "countdown"
    action_names: ClassVar[None] = None
    move_format: ClassVar[str] = "one equation"
    legend: ClassVar[None] = None
    # No coordinates: the state text is the same either way, so only "text" is offered.
    metadata: ClassVar[dict] = {"render_modes": ["text"]}
    instructions: ClassVar[dict[str, str]] = INSTRUCTIONS
    max_actions_per_traj: ClassVar[int] = 1

    def __init__(self, count: int = 4, max_number: int = 20, max_target: int = 100,
                 render_mode: str = "text"):
        super().__init__(render_mode=render_mode)
        if count < 2:
            raise EnvError(f"Countdown count must be at least 2, got {count}")
        if max_number < 1 or max_target < 1:
            raise EnvError("Countdown max_number and max_target must be at least 1")
        self.count, self.max_number, self.max_target = count, max_number, max_target
        self.numbers: list[int] = []
        self.target = 0
        self.answer: Equation | None = None

    def load_puzzle(self, numbers: list[int], target: int) -> None:
        """Play the puzzle given (e.g. in tests) instead of a generated one."""
        self.numbers, self.target, self.answer = list(numbers), target, None

    @property
    def solved(self) -> bool:
        return self.answer is not None and self.answer.value == self.target

    # ---- TextGameEnv hooks ---------------------------------------------------------------

    def _reset(self, rng: random.Random) -> None:
        self.load_puzzle(*generate_puzzle(rng, self.count, self.max_number, self.max_target))

    def parse_action(self, text: str) -> str | None:
        equation = parse_equation(text)
        return None if equation is None else equation.text

    def sample_action(self, rng: random.Random) -> str:
        """A random expression over a random selection of the numbers."""
        chosen = rng.sample(self._require_puzzle(), rng.randint(1, len(self.numbers)))
        return random_expression(rng, chosen, whole=False)[0]

    def _step(self, action: str) -> tuple[float, bool, bool, dict]:
        self._require_puzzle()
        equation = parse_equation(action)
        if self.answer is not None:  # the answer is final
            return 0.0, True, False, self._info(valid=equation is not None, effective=False,
                                                no_effect="the answer is already given")
        if equation is None or not Counter(equation.numbers) <= Counter(self.numbers):
            return 0.0, False, False, self._info(valid=False, effective=False,
                                                 no_effect="not an equation over the given numbers")
        self.answer = equation
        return float(self.solved), True, False, self._info(valid=True, effective=True)

    def render_grid(self) -> str:
        text = f"Target: {self.target}; numbers: {', '.join(map(str, self._require_puzzle()))}"
        if self.answer is not None:
            text += f"; equation: {self.answer.text} = {self.answer.value}"  # str(Fraction): 24, -3, 7/2
        return text

    def coordinate_line(self) -> str:
        return ""

    # ---- helpers -------------------------------------------------------------------------

    def _info(self, valid: bool, effective: bool, no_effect: str = "") -> dict:
        info = {"success": self.solved, "action_is_valid": valid, "action_is_effective": effective}
        return info | ({"no_effect": no_effect} if no_effect else {})

    def _require_puzzle(self) -> list[int]:
        if not self.numbers:
            raise EnvError("call reset() (or load_puzzle()) before using the Countdown env")
        return self.numbers
