"""The figures `spa eval` reports, as pure functions of trajectory dicts.

Everything here works on the trajectory records that the agent loop writes (one dict per
episode, see `Episode.to_json` in `stages.agent.rollout`), so a metric can be recomputed from a saved
``trajectories.jsonl`` without a model, and tested with hand-made records.

Three families:

* **Pass@k** (`pass_at_k`, `mean_pass_at_k`, `pass_at_k_curve`): the unbiased estimator of
  Chen et al. 2021, averaged over puzzles (seeds); `paired_difference` puts a bootstrap
  interval on the difference between two models evaluated on the same puzzles,
  `pooled_difference` on that between two sets of runs (RL seeds), `seed_verdict` says whether
  it holds in every run, and `pass_at_k_band` puts one on each k of a curve.
* **Episode aggregates** (`episode_metrics`): success rate (= Pass@1), reward, turns, actions,
  action validity and effectiveness, format-valid rate.
* **World-model accuracy** (`world_model_metrics`): how often the model's ``<observation>`` equals
  the state it was shown and its ``<prediction>`` equals the true state after its actions, both
  exactly and cell by cell on the grid (the comparisons live in `stages.agent.states`, shared
  with the VAGEN arm's state reward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from stages.agent.states import cell_accuracy, grid_cells, normalize_state, state_forms, states_match

Trajectory = Mapping[str, Any]

__all__ = ["cell_accuracy", "episode_metrics", "grid_cells", "mean_pass_at_k", "normalize_state", "paired_difference",
           "pass_at_k", "pass_at_k_curve", "per_seed_counts", "pooled_difference", "seed_verdict", "state_forms",
           "states_match", "summarize", "world_model_metrics"]

# ---- Pass@k ----------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of k samples succeeds, from n samples
    of which c succeeded (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

    The closed form is ``1 - C(n-c, k) / C(n, k)``; this computes it in the numerically stable
    product form ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which is 1 when ``n - c < k`` (every draw
    of k samples contains a success). At ``k = 1`` it equals ``c / n``.

    Raises ValueError when ``k > n`` (k samples cannot be drawn from n) or the counts are not
    ``0 <= c <= n``, ``k >= 1``.
    """
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per seed, got n={n}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """Pass@k averaged over puzzles: ``counts`` holds one ``(n, c)`` pair per seed.

    Each seed gets its own estimate from its own n and c; plugging totals over seeds into
    `pass_at_k` instead would be a different (and wrong) quantity.
    """
    counts = list(counts)
    if not counts:
        raise ValueError("pass@k needs at least one seed")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def pass_at_k_curve(per_seed: Sequence[Mapping[str, int]]) -> dict[int, float]:
    """Pass@k for every k from 1 to the smallest n of any seed.

    ``per_seed`` rows are ``{"seed", "n", "successes"}``, as in a report's ``per_seed`` list.
    """
    counts = [(row["n"], row["successes"]) for row in per_seed]
    if not counts:
        return {}
    k_max = min(n for n, _ in counts)
    return {k: mean_pass_at_k(counts, k) for k in range(1, k_max + 1)}


def paired_difference(first: Sequence[Mapping[str, int]], second: Sequence[Mapping[str, int]], k: int, *,
                      resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float] | None:
    """Pass@k of `second` minus Pass@k of `first`, with a 95% percentile interval, over the seeds
    both were evaluated on (``None`` when they share none, or a shared seed has fewer than k samples).

    The interval comes from resampling seeds with replacement (`bootstrap`), the same seeds for
    both models, so that how hard each puzzle is cancels out of the difference: with 128 puzzles
    the puzzles drawn, not the samples per puzzle, are most of the noise. Deterministic for a
    given `seed`.
    """
    a = {row["seed"]: (row["n"], row["successes"]) for row in first}
    b = {row["seed"]: (row["n"], row["successes"]) for row in second}
    shared = sorted(a.keys() & b.keys())
    if not shared or min(min(a[s][0], b[s][0]) for s in shared) < k:
        return None
    diffs = [[pass_at_k(*b[s], k) - pass_at_k(*a[s], k)] for s in shared]
    return bootstrap(diffs, resamples=resamples, seed=seed)[0]


def pooled_difference(first: Sequence[Sequence[Mapping[str, int]]], second: Sequence[Sequence[Mapping[str, int]]],
                      k: int, *, resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float] | None:
    """Pass@k of the runs `second` minus that of the runs `first` (each a report's ``per_seed``
    rows; several runs of one arm, e.g. its RL seeds, or one), with a 95% percentile interval.

    Each side's figure for a puzzle is the mean over its runs of that puzzle's Pass@k, so every run
    weighs the same; the puzzles are those every run was evaluated on, resampled with replacement
    as in `paired_difference` (which this is for one run a side). The interval covers which
    puzzles were drawn and the samples on them, not how much another training run would differ:
    a few runs cannot estimate that, and `seed_verdict` asks instead that none disagrees.
    ``None`` when the runs share no puzzle or a shared one has fewer than k samples in some run."""
    sides = [[{row["seed"]: (row["n"], row["successes"]) for row in run} for run in runs] for runs in (first, second)]
    shared = sorted(set.intersection(*(set(run) for runs in sides for run in runs)))
    if not shared or min(run[s][0] for runs in sides for run in runs for s in shared) < k:
        return None

    def side_mean(runs: list[dict[int, tuple[int, int]]], puzzle: int) -> float:
        return math.fsum(pass_at_k(*run[puzzle], k) for run in runs) / len(runs)

    diffs = [[side_mean(sides[1], s) - side_mean(sides[0], s)] for s in shared]
    return bootstrap(diffs, resamples=resamples, seed=seed)[0]


def seed_verdict(pooled: tuple[float, float, float] | None, runs: Sequence[float]) -> str:
    """Whether B differs from A, from `pooled_difference` and each run's own difference (each run of
    one side against all runs of the other): "higher" or "lower" when the pooled interval excludes
    0 and every run's difference has its sign, "not shown" otherwise: a conclusion that flips
    between runs is not one."""
    if pooled is None:
        return "not shown"
    _, low, high = pooled
    sign = 1 if low > 0 else -1 if high < 0 else 0
    if sign == 0 or any(difference * sign <= 0 for difference in runs):
        return "not shown"
    return "higher" if sign > 0 else "lower"


def pass_at_k_band(per_seed: Sequence[Mapping[str, int]], *, resamples: int = 2_000,
                   seed: int = 0) -> dict[int, tuple[float, float, float]]:
    """The Pass@k curve of `pass_at_k_curve` with a 95% interval at every k, from resampling the
    puzzles (`bootstrap`): ``{k: (Pass@k, low, high)}`` for k from 1 to the smallest n."""
    if not per_seed:
        return {}
    ks = range(1, min(row["n"] for row in per_seed) + 1)
    table = [[pass_at_k(row["n"], row["successes"], k) for k in ks] for row in per_seed]
    return dict(zip(ks, bootstrap(table, resamples=resamples, seed=seed)))


def bootstrap(table: Sequence[Sequence[float]], *, resamples: int = 10_000,
              seed: int = 0) -> list[tuple[float, float, float]]:
    """For a table with one row per puzzle and one column per figure: each column's mean over
    the puzzles with the 2.5% and 97.5% percentiles of that mean when the puzzles are drawn again
    with replacement, `resamples` times, the same draw for every column. Deterministic for a
    given `seed`."""
    import numpy as np

    values = np.asarray(table, dtype=float)  # (puzzles, figures)
    puzzles = len(values)
    draws = np.random.default_rng(seed).multinomial(puzzles, [1 / puzzles] * puzzles, size=resamples)
    means = np.sort(draws @ values / puzzles, axis=0)  # (resamples, figures), each column sorted
    low, high = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return [(float(m), float(lo), float(hi)) for m, lo, hi in zip(values.mean(axis=0), low, high)]


def per_seed_counts(trajectories: Iterable[Trajectory]) -> list[dict[str, int]]:
    """``[{"seed", "n", "successes"}]`` sorted by seed: samples and successes of each puzzle."""
    table: dict[int, list[int]] = {}
    for trajectory in trajectories:
        row = table.setdefault(int(trajectory["seed"]), [0, 0])
        row[0] += 1
        row[1] += bool(trajectory["success"])
    return [{"seed": seed, "n": n, "successes": c} for seed, (n, c) in sorted(table.items())]


# ---- episode aggregates ----------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def episode_metrics(trajectories: Sequence[Trajectory],
                    understands: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Aggregates over episodes; a figure with nothing to average over is None.

    * ``episodes``: number of episodes.
    * ``success_rate``: mean of ``success`` over all episodes (this is Pass@1).
    * ``mean_reward``: mean ``total_reward`` as the agent loop records it (the environment's
      rewards plus the format penalty, the scalar PPO trains on); ``mean_format_penalty``: mean
      ``format_penalty``, the part of it that is penalty.
    * ``mean_turns``: model turns per episode; ``mean_actions``: actions executed per episode
      (the paper's "average actions").
    * ``action_validity``: share of the actions the model wrote (a turn's ``actions``) that the
      game understood. Per turn, the first source available decides: the turn's ``action_valid``
      flags (one per written action); else ``understands(action_text)`` (the game's
      ``parse_action``, which `spa eval` passes); else, from the record alone, an action counts
      as understood when it was executed, and a turn that ended the episode (whose later actions
      were never tried) counts only the actions it executed.
    * ``action_effectiveness``: share of executed actions that changed the state. Per turn it
      uses ``action_effective`` flags (one per executed action) when present; otherwise a turn
      counts as all-effective when its ``next_state`` differs from its ``state`` and
      all-ineffective when not (exact for one-action turns, an upper bound for longer ones).
    * ``format_valid_rate``: share of turns with ``format_ok``.
    """
    turns = [turn for trajectory in trajectories for turn in trajectory["turns"]]
    written = understood = executed = effective = 0
    for turn in turns:
        actions, done_actions = turn.get("actions") or [], turn.get("executed") or []
        executed += len(done_actions)
        valid_flags = turn.get("action_valid")
        if valid_flags is not None:
            written += len(valid_flags)
            understood += sum(map(bool, valid_flags))
        elif understands is not None:
            written += len(actions)
            understood += sum(bool(understands(action)) for action in actions)
        elif turn.get("done") and len(done_actions) < len(actions):
            written += len(done_actions)  # the episode ended before the rest were tried
            understood += len(done_actions)
        else:
            written += len(actions)
            understood += min(len(done_actions), len(actions))
        effective_flags = turn.get("action_effective")
        if effective_flags is not None:
            effective += sum(map(bool, effective_flags))
        elif done_actions and turn.get("next_state") != turn.get("state"):
            effective += len(done_actions)
    return {
        "episodes": len(trajectories),
        "success_rate": _mean([float(bool(t["success"])) for t in trajectories]),
        "mean_reward": _mean([float(t["total_reward"]) for t in trajectories]),
        "mean_format_penalty": _mean([float(t.get("format_penalty") or 0.0) for t in trajectories]),
        "mean_turns": _mean([len(t["turns"]) for t in trajectories]),
        "mean_actions": _mean([sum(len(turn.get("executed") or []) for turn in t["turns"])
                               for t in trajectories]),
        "action_validity": _ratio(understood, written),
        "action_effectiveness": _ratio(effective, executed),
        "format_valid_rate": _ratio(sum(bool(turn.get("format_ok")) for turn in turns), len(turns)),
    }


# ---- world-model accuracy --------------------------------------------------------------------


_WM_KINDS = (("observation", "state"), ("prediction", "next_state"))


def world_model_metrics(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """Accuracy of the model's own state descriptions, over the turns where it wrote the tag.

    * ``observation`` is compared with the turn's ``state`` (the text it was shown);
    * ``prediction`` with the turn's ``next_state`` (the true state after the turn's actions);
    * ``prediction_of_change``: the predictions of the turns whose actions changed the state (the
      true next state differs from the state). Copying the observation is an exact prediction
      whenever the actions changed nothing (a Sokoban move into a wall), so ``prediction`` alone
      cannot tell a world model from a copier; this can.

    For each kind: ``turns`` (turns with the tag), ``coverage`` (their share of all turns),
    ``exact_match`` (share equal to the truth after `normalize_state`), ``cell_accuracy``
    (mean over those turns of `cell_accuracy`), and the exact shares of each form of the state
    apart (`state_forms`): ``grid_exact`` (the grid part equals the truth's) and
    ``coordinates_exact`` (the coordinate lines do; over the turns whose true state has them);
    each None when no turn has the tag. ``per_turn`` lists
    the observation and prediction figures by turn number (1-based), so a reader sees whether
    accuracy holds up as the episode goes on.
    """
    total_turns = sum(len(t["turns"]) for t in trajectories)
    overall = {kind: _WmTally() for kind, _ in _WM_KINDS}
    of_change = _WmTally()
    turns_at: dict[int, int] = {}  # turn number -> episodes that reached it
    by_turn: dict[int, dict[str, _WmTally]] = {}
    for trajectory in trajectories:
        for number, turn in enumerate(trajectory["turns"], 1):
            turns_at[number] = turns_at.get(number, 0) + 1
            tallies = by_turn.setdefault(number, {kind: _WmTally() for kind, _ in _WM_KINDS})
            for kind, truth_key in _WM_KINDS:
                written, truth = turn.get(kind), turn.get(truth_key)
                if written is None or truth is None:
                    continue
                figures = _state_figures(written, truth)
                overall[kind].add(*figures)
                tallies[kind].add(*figures)
                if kind == "prediction" and not states_match(turn["state"], truth):
                    of_change.add(*figures)
    result: dict[str, Any] = {kind: overall[kind].summary(total_turns) for kind, _ in _WM_KINDS}
    result["prediction_of_change"] = of_change.summary(total_turns)
    result["per_turn"] = [
        {"turn": number, "turns": turns_at[number],
         **{kind: tallies[kind].summary(turns_at[number]) for kind, _ in _WM_KINDS}}
        for number, tallies in sorted(by_turn.items())
    ]
    return result


def _state_figures(written: str, truth: str) -> tuple[bool, float, bool, bool | None]:
    """A written state against the true one: exact, cells right, grid exact, coordinates exact
    (None when the truth has no coordinate line)."""
    (grid, coordinates), (true_grid, true_coordinates) = state_forms(written), state_forms(truth)
    return (states_match(written, truth), cell_accuracy(written, truth), grid == true_grid,
            coordinates == true_coordinates if true_coordinates else None)


class _WmTally:
    """Running counts of one world-model figure."""

    def __init__(self) -> None:
        self.turns = self.exact = self.grid = self.coordinate_turns = self.coordinates = 0
        self.cells = 0.0

    def add(self, exact: bool, cells: float, grid: bool, coordinates: bool | None) -> None:
        self.turns += 1
        self.exact += exact
        self.cells += cells
        self.grid += grid
        if coordinates is not None:
            self.coordinate_turns += 1
            self.coordinates += coordinates

    def summary(self, all_turns: int) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "coverage": _ratio(self.turns, all_turns),
            "exact_match": _ratio(self.exact, self.turns),
            "cell_accuracy": self.cells / self.turns if self.turns else None,
            "grid_exact": _ratio(self.grid, self.turns),
            "coordinates_exact": _ratio(self.coordinates, self.coordinate_turns),
        }


# ---- everything at once ----------------------------------------------------------------------


def summarize(trajectories: Sequence[Trajectory],
              understands: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Every metric of a report's ``metrics`` section from the episodes (``understands``: see
    `episode_metrics`).

    ``pass@1`` and the ``pass_at_k`` curve (keys are k as strings, for JSON) come from the
    per-seed counts; ``pass@1`` equals ``success_rate`` when every seed has the same n.
    """
    per_seed = per_seed_counts(trajectories)
    curve = pass_at_k_curve(per_seed)
    return {
        "pass@1": curve.get(1),
        "pass_at_k": {str(k): value for k, value in curve.items()},
        **episode_metrics(trajectories, understands),
        "world_model": world_model_metrics(trajectories),
    }

