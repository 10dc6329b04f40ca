"""Parsing the agent's response, and the format check of `spa clean` (SPA's released ctx_manager
and `sft/filter_sft_by_tag.py`).

SPA's regexes (DOTALL, searched anywhere in the text):

* world model: ``<think>\\s*<observation>(.*?)</observation>(.*?)<prediction>(.*?)</prediction>``
  ``\\s*</think>\\s*<answer>(.*?)</answer>``
* base: ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>``

Our parser accepts the same texts and captures the same groups, with two tolerances: tags may
carry inner whitespace and any letter case (``< Answer >``, ``</ THINK>``). It does not run the
regex itself: a backtracking regex with four lazy groups goes polynomial on degenerate outputs that
repeat tags (weak models do), so the pieces are searched one after another. This finds exactly
the regex's match: each lazy group ends at the first closing piece after it, and if that first
choice cannot be completed, no later one can (every later piece is found further right).

Differences from SPA's code, on purpose:

* Malformed output gives ``format_ok=False`` and no actions. SPA stores the answer *string* and
  iterates over its characters as actions (a quirk that burns Sudoku's budget); the notes advise
  "no actions + format penalty", which is what the rollout does with this result.
* The parser never raises, whatever the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from stages.agent.prompts import ACTION_SEPARATOR, GENERATION_PREFIX

_FLAGS = re.DOTALL | re.IGNORECASE


def _tag(name: str, closing: bool = False) -> str:
    """Regex of one tag, tolerant to case and inner whitespace: `< / think >`."""
    return rf"<\s*{'/' if closing else ''}\s*{name}\s*>"


def _compile(*parts: str) -> re.Pattern[str]:
    return re.compile(r"\s*".join(parts), _FLAGS)


# The fixed pieces of the two regexes; pieces SPA joins with \s* are one pattern here.
_WM_PIECES = (
    _compile(_tag("think"), _tag("observation")),
    re.compile(_tag("observation", True), _FLAGS),
    re.compile(_tag("prediction"), _FLAGS),
    _compile(_tag("prediction", True), _tag("think", True), _tag("answer")),
    re.compile(_tag("answer", True), _FLAGS),
)
_BASE_PIECES = (
    re.compile(_tag("think"), _FLAGS),
    _compile(_tag("think", True), _tag("answer")),
    re.compile(_tag("answer", True), _FLAGS),
)
# Stripped from every captured group, like SPA's special-token list.
_SPECIAL = re.compile(r"<\s*/?\s*(?:think|observation|prediction|answer)\s*>|<\|im_start\|>|<\|im_end\|>",
                      re.IGNORECASE)


@dataclass(frozen=True)
class ParsedResponse:
    """What a response says. Missing parts are None; `actions` is empty unless `format_ok`."""

    format_ok: bool
    observation: str | None = None
    prediction: str | None = None
    thoughts: str | None = None
    answer: str | None = None
    actions: list[str] = field(default_factory=list)


def parse_response(completion: str, prompt_mode: str = "world_model", max_actions: int = 5,
                   prefix: str = GENERATION_PREFIX) -> ParsedResponse:
    """Parse a completion generated after `prefix` ("<think>", which the prompt ended with).

    Actions: the answer split on "||", stripped, empties dropped, the first `max_actions` kept.
    """
    text = prefix + completion
    if prompt_mode == "world_model":
        groups = _chain(text, _WM_PIECES)
        if groups is None:
            return ParsedResponse(format_ok=False)
        observation, thoughts, prediction, answer = (_clean(g) for g in groups)
    else:
        groups = _chain(text, _BASE_PIECES)
        if groups is None:
            return ParsedResponse(format_ok=False)
        raw_thoughts, raw_answer = groups
        thoughts, answer = _clean(raw_thoughts), _clean(raw_answer)
        # A world-model-trained policy keeps writing states in base mode (PPO); keep them for metrics.
        observation, prediction = _inner(raw_thoughts, "observation"), _inner(raw_thoughts, "prediction")
    return ParsedResponse(True, observation, prediction, thoughts, answer, split_actions(answer, max_actions))


def split_actions(answer: str, max_actions: int) -> list[str]:
    actions = [part.strip() for part in answer.split(ACTION_SEPARATOR)]
    return [a for a in actions if a][:max(max_actions, 0)]


def _chain(text: str, pieces: tuple[re.Pattern[str], ...]) -> list[str] | None:
    """The text between consecutive pieces, each piece searched after the previous one, or None."""
    match = pieces[0].search(text)
    if match is None:
        return None
    groups = []
    for piece in pieces[1:]:
        following = piece.search(text, match.end())
        if following is None:
            return None
        groups.append(text[match.end():following.start()])
        match = following
    return groups


def _clean(group: str) -> str:
    return _SPECIAL.sub("", group).strip()


def _inner(text: str, name: str) -> str | None:
    match = STATE_PATTERNS[name].search(text)
    return _clean(match.group(2)) if match else None


# ---- state tags: `spa clean` rewrites their contents, `spa sft --state-text` masks them -----------

STATE_TAGS = ("observation", "prediction")
#: (opening tag, content, closing tag) of every observation / prediction, tolerant like the parser.
STATE_PATTERNS = {tag: re.compile(f"({_tag(tag)})(.*?)({_tag(tag, True)})", _FLAGS) for tag in STATE_TAGS}


def replace_states(content: str, observation: str, prediction: str) -> str:
    """Every observation and prediction tag's content replaced, the tags themselves kept as written."""
    # Functions, not replacement strings: a state may hold backslashes.
    content = STATE_PATTERNS["observation"].sub(lambda m: m.group(1) + observation + m.group(3), content)
    return STATE_PATTERNS["prediction"].sub(lambda m: m.group(1) + prediction + m.group(3), content)


def state_spans(text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """Character spans of the observation/prediction contents (tags excluded) inside [start, end)."""
    end = len(text) if end is None else end
    return [m.span(2) for pattern in STATE_PATTERNS.values() for m in pattern.finditer(text, start, end)]


# ---- the format filter of `spa clean` ------------------------------------------------------------

_THINK_SPAN = re.compile(f"{_tag('think')}(.*?){_tag('think', True)}", _FLAGS)
_ANSWER_SPAN = re.compile(f"{_tag('answer')}.*?{_tag('answer', True)}", _FLAGS)


def well_formed(content: str, prompt_mode: str = "world_model") -> bool:
    """SPA's SFT filter (`sft/filter_sft_by_tag.py`) on one assistant message.

    A `<think>…</think>` and an `<answer>…</answer>` with the think block first; in world-model
    mode the think block also holds an `<observation>…</observation>` and a
    `<prediction>…</prediction>`, the first observation before the first prediction. Looser than
    the rollout parser: text around the tags is allowed.
    """
    think = _THINK_SPAN.search(content)
    answer = _ANSWER_SPAN.search(content)
    if think is None or answer is None or answer.start() < think.end():
        return False
    if prompt_mode != "world_model":
        return True
    observation = STATE_PATTERNS["observation"].search(think.group(1))
    prediction = STATE_PATTERNS["prediction"].search(think.group(1))
    return observation is not None and prediction is not None and observation.start() < prediction.start()
