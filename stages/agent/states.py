"""Comparing a state the agent wrote with the true one, and VAGEN's reward for getting it right.

The comparisons are what `spa eval` reports as world-model accuracy (`stages.evaluation.metrics`)
and what the VAGEN arm's PPO rewards (`StateReward`); both sit here, in the agent loop, so the
reward and the metric are one implementation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def normalize_state(text: str) -> str:
    """A state text with each line stripped and blank lines at either end dropped.

    Exact match compares texts after this: the model may indent lines or leave trailing spaces
    (Sudoku's board ends with one), which says nothing about its picture of the state.
    """
    return "\n".join(line.strip() for line in text.strip().splitlines())


def states_match(predicted: str, true: str) -> bool:
    return normalize_state(predicted) == normalize_state(true)


# A coordinate line mentions a zero- or one-indexed "(r,c)" pair, or says Sudoku has none left.
_COORDINATE_LINE = re.compile(r"\(\s*\d+\s*,\s*\d+\s*\)|no empty position", re.IGNORECASE)


def state_forms(text: str) -> tuple[str, str]:
    """A state text split into the two forms it writes a state in: the grid (every line before the
    first coordinate line, a line with an ``(r,c)`` pair or Sudoku's "No empty positions") and the
    coordinates (that line and the ones after it), each as `normalize_state` leaves it; a text
    without a coordinate line has an empty second part.

    The paper's states carry both (the grid, then ``Player (P) is at (r,c); ...``), and a model
    can get one right and the other wrong: world-model accuracy reports each form apart."""
    lines = normalize_state(text).splitlines()
    split = next((i for i, line in enumerate(lines) if _COORDINATE_LINE.search(line)), len(lines))
    return normalize_state("\n".join(lines[:split])), normalize_state("\n".join(lines[split:]))


def grid_cells(text: str) -> list[list[str]]:
    """The grid part of a state text (`state_forms`) as rows of cells.

    Blank lines carry no cells and are skipped. A line starting with ``|`` is a Sudoku board,
    ``| . 1 2 4 | 4 2 1 3 | ...``: each ``|``-separated segment is a row and its space-separated
    tokens are the cells. Any other line is one row of one-character cells (Sokoban, FrozenLake).
    """
    rows: list[list[str]] = []
    for line in state_forms(text)[0].splitlines():
        if not line:
            continue
        if line.startswith("|"):
            rows += [segment.split() for segment in line.split("|")[1:]]
        else:
            rows.append(list(line))
    return rows


def cell_accuracy(predicted: str, true: str) -> float:
    """Share of grid cells the predicted state text gets right, against the true state text.

    Rows and columns are compared by position. Every cell position that either grid has is
    judged, and it is right only when both grids have it and agree; so a missing row or a short
    row costs the true cells it lacks, and an extra row or a long row costs the cells it adds.
    Accuracy = right / judged (1.0 when both grids are empty).
    """
    pred_rows, true_rows = grid_cells(predicted), grid_cells(true)
    right = judged = 0
    for r in range(max(len(pred_rows), len(true_rows))):
        pred_row = pred_rows[r] if r < len(pred_rows) else []
        true_row = true_rows[r] if r < len(true_rows) else []
        judged += max(len(pred_row), len(true_row))
        right += sum(p == t for p, t in zip(pred_row, true_row))
    return right / judged if judged else 1.0


#: How a written state is scored against the truth.
STATE_SCORES = ("exact", "cells")


@dataclass(frozen=True)
class StateReward:
    """VAGEN's per-turn reward for grounding and world modelling, "in the same state-estimation
    setting" as the paper reimplements it (reference notes §7.3).

    Each turn gains ``observation_weight x score(<observation>, the state shown this turn) +
    prediction_weight x score(<prediction>, the true state after the turn's actions)``, where score
    is 1 or 0 for an exact match after `normalize_state` (``kind="exact"``) or the share of grid
    cells right (``kind="cells"``, `cell_accuracy`, VAGEN's partial-credit flavour); a state the
    turn did not write scores 0. The paper does not publish its weights; the 0.5 and 0.5 of
    `spa ppo`'s defaults are VAGEN's own defaults (its env configs' grounding and world-modelling
    reward weights), a choice of ours.
    """

    kind: str
    observation_weight: float
    prediction_weight: float

    def __post_init__(self) -> None:
        if self.kind not in STATE_SCORES:
            raise ValueError(f"state reward kind must be one of {', '.join(STATE_SCORES)}, got {self.kind!r}")

    def score(self, written: str | None, true: str) -> float:
        if written is None:
            return 0.0
        return float(states_match(written, true)) if self.kind == "exact" else cell_accuracy(written, true)

    def parts(self, observation: str | None, prediction: str | None, state: str,
              next_state: str) -> tuple[float, float]:
        """The turn's (observation, prediction) rewards, each weighted; their sum is the turn's reward."""
        return (self.observation_weight * self.score(observation, state),
                self.prediction_weight * self.score(prediction, next_state))

    def __call__(self, observation: str | None, prediction: str | None, state: str, next_state: str) -> float:
        return sum(self.parts(observation, prediction, state, next_state))
