"""The metrics of `spa eval` against closed forms and hand-made trajectories."""

import math
from fractions import Fraction

import pytest

from stages.evaluation.metrics import (
    cell_accuracy,
    episode_metrics,
    grid_cells,
    mean_pass_at_k,
    normalize_state,
    paired_difference,
    pass_at_k,
    pass_at_k_curve,
    per_seed_counts,
    state_forms,
    states_match,
    summarize,
    world_model_metrics,
)

# ---- pass@k ------------------------------------------------------------------------------------


def closed_form(n: int, c: int, k: int) -> Fraction:
    """1 - C(n-c, k) / C(n, k), exactly (math.comb is 0 when n - c < k)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize("n", range(1, 13))
def test_estimator_equals_the_closed_form_exhaustively(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(closed_form(n, c, k)), abs=1e-12), (n, c, k)


def test_edge_cases():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 0, 8) == 0.0  # no success: never
    assert pass_at_k(8, 8, 1) == 1.0 and pass_at_k(8, 8, 8) == 1.0  # all successes: always
    assert pass_at_k(8, 3, 6) == 1.0  # n - c = 5 < k: every draw of 6 holds a success
    assert pass_at_k(8, 1, 8) == 1.0  # pass@n is "any success"
    for n in range(1, 13):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_values_by_hand():
    # n=4, c=1: pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; verl's bootstrap would say 0.4375.
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=10, c=2, k=3: 1 - C(8,3)/C(10,3) = 1 - 56/120.
    assert pass_at_k(10, 2, 3) == pytest.approx(1 - 56 / 120)


def test_large_n_is_numerically_stable():
    # C(2000, 1000) overflows a float; the product form does not.
    value = pass_at_k(2000, 3, 1000)
    assert value == pytest.approx(1 - (1000 * 999 * 998) / (2000 * 1999 * 1998))
    assert 0.0 <= pass_at_k(1024, 1, 1) <= 1.0


@pytest.mark.parametrize("n, c, k", [(4, 1, 5), (0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 1, 0)])
def test_bad_counts_are_refused(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_k_larger_than_n_names_the_problem():
    with pytest.raises(ValueError, match=r"pass@9 needs at least 9 samples per seed, got n=8"):
        pass_at_k(8, 2, 9)


def test_mean_over_seeds_is_per_seed_not_pooled():
    counts = [(4, 0), (4, 4), (4, 1)]
    assert mean_pass_at_k(counts, 2) == pytest.approx((0 + 1 + 0.5) / 3)
    # Pooling (12 samples, 5 successes) would give 1 - C(7,2)/C(12,2) = 0.6818..., a different number.
    assert mean_pass_at_k(counts, 2) != pytest.approx(pass_at_k(12, 5, 2))
    with pytest.raises(ValueError):
        mean_pass_at_k([], 1)


def test_curve_runs_to_the_smallest_n_and_rises():
    curve = pass_at_k_curve([{"seed": 1, "n": 4, "successes": 1}, {"seed": 2, "n": 4, "successes": 0}])
    assert list(curve) == [1, 2, 3, 4]
    assert curve[1] == pytest.approx(0.125) and curve[4] == pytest.approx(0.5)
    assert all(a <= b for a, b in zip(curve.values(), list(curve.values())[1:]))
    assert pass_at_k_curve([]) == {}


def test_per_seed_counts():
    trajectories = [{"seed": 124, "success": True}, {"seed": 123, "success": False},
                    {"seed": 124, "success": False}, {"seed": 123, "success": True},
                    {"seed": 124, "success": True}]
    assert per_seed_counts(trajectories) == [{"seed": 123, "n": 2, "successes": 1},
                                             {"seed": 124, "n": 3, "successes": 2}]


def seeds(*counts: tuple[int, int], first: int = 123) -> list[dict[str, int]]:
    return [{"seed": first + i, "n": n, "successes": c} for i, (n, c) in enumerate(counts)]


def test_paired_difference_of_a_model_with_itself_is_zero_with_no_spread():
    counts = seeds((8, 0), (8, 3), (8, 8))
    assert paired_difference(counts, counts, 1) == (0.0, 0.0, 0.0)


def test_paired_difference_by_hand():
    # Per-seed differences 0 and 1: a resample's mean is 0, 1/2 or 1 with chances 1/4, 1/2, 1/4,
    # so the 2.5% and 97.5% points of 10,000 resamples are 0 and 1.
    first, second = seeds((2, 1), (2, 0)), seeds((2, 1), (2, 2))
    assert paired_difference(first, second, 1) == (0.5, 0.0, 1.0)
    # Pass@2 per seed: 1 vs 1 and 0 vs 1.
    assert paired_difference(first, second, 2) == (0.5, 0.0, 1.0)


def test_a_constant_per_seed_difference_has_no_spread():
    first, second = seeds((4, 1), (4, 2), (4, 0)), seeds((4, 2), (4, 3), (4, 1))
    assert paired_difference(first, second, 1) == (0.25, 0.25, 0.25)


def test_paired_difference_uses_shared_seeds_only_and_needs_k_samples():
    first, second = seeds((4, 4), (4, 0)), seeds((4, 0), first=124)  # shared: seed 124
    assert paired_difference(first, second, 1) == (0.0, 0.0, 0.0)
    assert paired_difference(first, seeds((4, 0), first=200), 1) is None
    assert paired_difference(first, second, 8) is None


def test_paired_difference_is_deterministic_and_its_interval_holds_the_difference():
    first = seeds(*[(8, (3 * i) % 9) for i in range(40)])
    second = seeds(*[(8, (5 * i + 2) % 9) for i in range(40)])
    diff, low, high = paired_difference(first, second, 1)
    assert diff == pytest.approx(sum(((5 * i + 2) % 9 - (3 * i) % 9) / 8 for i in range(40)) / 40)
    assert low < diff < high
    assert paired_difference(first, second, 1) == (diff, low, high)


# ---- episode aggregates ------------------------------------------------------------------------


def turn(state="A", next_state="B", actions=("Up",), executed=("Up",), format_ok=True, done=False,
         observation=None, prediction=None, **extra):
    return {"state": state, "next_state": next_state, "actions": list(actions), "executed": list(executed),
            "format_ok": format_ok, "done": done, "observation": observation, "prediction": prediction,
            "reward": -0.1, **extra}


def episode(seed, success, turns, total_reward=0.0, format_penalty=0.0, sample=0):
    return {"id": f"e{seed}-{sample}", "seed": seed, "sample": sample, "success": success, "turns": turns,
            "total_reward": total_reward, "format_penalty": format_penalty}


def test_episode_aggregates_by_hand():
    trajectories = [
        episode(1, True, [turn(actions=("Up", "Jump", "Left"), executed=("Up", "Left")),
                          turn(actions=("Down",), executed=("Down",), done=True)],
                total_reward=10.7, format_penalty=-0.1),
        episode(1, False, [turn(state="S", next_state="S", actions=(), executed=(), format_ok=False),
                           turn(state="S", next_state="T", actions=("Up", "Up"), executed=("Up", "Up"))],
                total_reward=-0.2, format_penalty=-0.1),
    ]
    metrics = episode_metrics(trajectories)
    assert metrics["episodes"] == 2
    assert metrics["success_rate"] == 0.5
    assert metrics["mean_reward"] == pytest.approx((10.7 - 0.2) / 2)
    assert metrics["mean_format_penalty"] == pytest.approx(-0.1)
    assert metrics["mean_turns"] == 2
    assert metrics["mean_actions"] == pytest.approx((3 + 2) / 2)
    assert metrics["action_validity"] == pytest.approx(5 / 6)  # "Jump" was not understood
    # The format-failed turn executed nothing; every other turn changed the state.
    assert metrics["action_effectiveness"] == 1.0
    assert metrics["format_valid_rate"] == pytest.approx(3 / 4)


def test_per_action_flags_win_over_the_fallback():
    trajectories = [episode(1, False, [
        turn(actions=("1,1,1", "9,9,9", "1,2,3"), executed=("1,1,1", "9,9,9", "1,2,3"),
             action_valid=[True, False, True], action_effective=[True, False, False]),
        turn(state="X", next_state="X", actions=("Up",), executed=("Up",)),  # a push into a wall
    ])]
    metrics = episode_metrics(trajectories)
    assert metrics["action_validity"] == pytest.approx(3 / 4)
    assert metrics["action_effectiveness"] == pytest.approx(1 / 4)


def test_a_turn_cut_short_by_the_end_counts_only_tried_actions():
    trajectories = [episode(1, True, [turn(actions=("Up", "Up", "Up"), executed=("Up",), done=True)])]
    assert episode_metrics(trajectories)["action_validity"] == 1.0


def test_the_games_parser_judges_validity_when_given():
    trajectories = [episode(1, True, [turn(actions=("Up", "jump", "up"), executed=("Up",), done=True)])]
    metrics = episode_metrics(trajectories, lambda action: action.lower() in {"up", "down"})
    assert metrics["action_validity"] == pytest.approx(2 / 3)


def test_empty_inputs_give_none_not_errors():
    metrics = episode_metrics([])
    assert metrics["episodes"] == 0 and metrics["success_rate"] is None and metrics["action_validity"] is None
    no_actions = episode_metrics([episode(1, False, [turn(actions=(), executed=(), format_ok=False)])])
    assert no_actions["action_validity"] is None and no_actions["action_effectiveness"] is None


# ---- world-model accuracy ----------------------------------------------------------------------

SOKOBAN = ("######\n#P___#\n#_XO_#\n######\n######\n######\n"
           "Player (P) is at (1,1); box (X) is at (2,2); target (O) is at (2,3).")
SOKOBAN_NEXT = ("######\n#____#\n#_PXO#\n######\n######\n######\n"
                "Player (P) is at (2,2); box (X) is at (2,3); target (O) is at (2,4).")
SUDOKU = "| . 1 2 4 | 4 2 1 3 | 2 3 4 1 | . 4 . 2 \nEmpty positions to be filled are at (1,1), (4,1), (4,3)."


def test_normalisation_strips_each_line():
    assert normalize_state("  ##\n #P# \n\n") == "##\n#P#"
    assert states_match(" | . 1 2 4 | 4 2 1 3 | 2 3 4 1 | . 4 . 2\n  Empty positions to be filled are at "
                        "(1,1), (4,1), (4,3).", SUDOKU)
    assert not states_match(SOKOBAN.replace("P", "_", 1), SOKOBAN)


def test_grid_part_stops_at_the_coordinate_line():
    assert grid_cells(SOKOBAN) == [list("######"), list("#P___#"), list("#_XO_#")] + [list("######")] * 3
    assert grid_cells("_O__\nO___\nG___\n__P_") == [list("_O__"), list("O___"), list("G___"), list("__P_")]
    assert grid_cells(SUDOKU) == [[".", "1", "2", "4"], ["4", "2", "1", "3"], ["2", "3", "4", "1"],
                                  [".", "4", ".", "2"]]
    assert grid_cells("| 1 2 3 4 | 3 4 1 2 | 2 1 4 3 | 4 3 2 1 \nNo empty positions found (board might be "
                      "complete).") == [["1", "2", "3", "4"], ["3", "4", "1", "2"], ["2", "1", "4", "3"],
                                        ["4", "3", "2", "1"]]


def test_cell_accuracy_by_hand():
    assert cell_accuracy(SOKOBAN, SOKOBAN) == 1.0
    # Only the grid is judged: a wrong coordinate line does not cost cells.
    assert cell_accuracy(SOKOBAN.replace("(2,3).", "(5,5)."), SOKOBAN) == 1.0
    # The player drawn one cell off: two of 36 cells wrong.
    assert cell_accuracy(SOKOBAN.replace("#P___#", "#_P__#"), SOKOBAN) == pytest.approx(34 / 36)
    # Sudoku compares its 16 cells: two wrong here.
    guess = "| 3 1 2 4 | 4 2 1 3 | 2 3 4 1 | 1 4 . 2 \nEmpty position to be filled is at (4,3)."
    assert cell_accuracy(guess, SUDOKU) == pytest.approx(14 / 16)


def test_cell_accuracy_penalises_wrong_sizes():
    true = "_O__\nO___\nG___\n__P_"
    assert cell_accuracy("_O__\nO___\nG___", true) == pytest.approx(12 / 16)  # a row missing
    assert cell_accuracy(true + "\n____", true) == pytest.approx(16 / 20)  # an extra row
    assert cell_accuracy("_O_\nO__\nG__\n__P", true) == pytest.approx(12 / 16)  # a column short
    assert cell_accuracy("_O___\nO____\nG____\n__P__", true) == pytest.approx(16 / 20)  # a column long
    assert cell_accuracy("", true) == 0.0
    assert cell_accuracy("| 1 2 | 3 4", SUDOKU) == pytest.approx(0 / 16)  # rows of 2 cells, all wrong
    assert cell_accuracy("", "") == 1.0


def test_world_model_metrics_on_hand_made_turns():
    trajectories = [
        episode(1, False, [
            # Observation exact (modulo spaces), prediction off by the player's cell.
            turn(state=SOKOBAN, next_state=SOKOBAN_NEXT, observation="  " + SOKOBAN.replace("\n", " \n"),
                 prediction=SOKOBAN_NEXT.replace("#_PXO#", "#P_XO#")),
            # Observation a row short, no prediction tag.
            turn(state=SOKOBAN_NEXT, next_state=SOKOBAN_NEXT,
                 observation="\n".join(SOKOBAN_NEXT.split("\n")[:5])),
        ]),
        episode(1, True, [
            turn(state=SUDOKU, next_state=SUDOKU, observation=SUDOKU, prediction=SUDOKU),
            turn(state=SUDOKU, next_state=SUDOKU),  # base-mode turn: no tags at all
        ]),
    ]
    wm = world_model_metrics(trajectories)
    obs, pred = wm["observation"], wm["prediction"]
    assert obs["turns"] == 3 and obs["coverage"] == pytest.approx(3 / 4)
    assert obs["exact_match"] == pytest.approx(2 / 3)
    assert obs["cell_accuracy"] == pytest.approx((1 + 30 / 36 + 1) / 3)
    assert pred["turns"] == 2 and pred["coverage"] == pytest.approx(2 / 4)
    assert pred["exact_match"] == pytest.approx(1 / 2)
    assert pred["cell_accuracy"] == pytest.approx((34 / 36 + 1) / 2)
    # Of the two predictions only the first turn's state changed (Sudoku's prediction is a copy).
    assert wm["prediction_of_change"] == {"turns": 1, "coverage": 1 / 4, "exact_match": 0.0,
                                          "cell_accuracy": pytest.approx(34 / 36), "grid_exact": 0.0,
                                          "coordinates_exact": 1.0}
    # Each form apart: the short observation misses a grid row and the coordinate line; the first
    # prediction draws the player one cell off but writes the true coordinates.
    assert obs["grid_exact"] == pytest.approx(2 / 3) and obs["coordinates_exact"] == pytest.approx(2 / 3)
    assert pred["grid_exact"] == 0.5 and pred["coordinates_exact"] == 1.0
    first, second = wm["per_turn"]
    assert first["turn"] == 1 and first["turns"] == 2
    assert first["observation"]["exact_match"] == 1.0 and first["prediction"]["exact_match"] == 0.5
    assert second["turn"] == 2 and second["turns"] == 2
    assert second["observation"]["turns"] == 1 and second["observation"]["exact_match"] == 0.0
    assert second["prediction"] == {"turns": 0, "coverage": 0.0, "exact_match": None, "cell_accuracy": None,
                                    "grid_exact": None, "coordinates_exact": None}


def test_state_forms_split_the_grid_from_the_coordinates():
    grid, coordinates = SOKOBAN.rsplit("\n", 1)
    assert state_forms(SOKOBAN) == (grid, coordinates)
    assert state_forms("  " + SOKOBAN.replace("\n", " \n") + "\n\n") == (grid, coordinates)
    assert state_forms(SUDOKU) == (SUDOKU.split(" \n")[0], SUDOKU.split("\n")[1])
    assert state_forms("_O__\nO___\nG___\n__P_") == ("_O__\nO___\nG___\n__P_", "")  # a raw grid
    assert state_forms("Player (P) is at (1,1).") == ("", "Player (P) is at (1,1).")  # coordinates alone


def test_coordinates_are_judged_only_where_the_truth_has_them():
    raw, coords = "_O__\nO___\nG___\n__P_", "_O__\nO___\nG___\n__P_\nPlayer (P) is at (3,2)."
    trajectories = [episode(1, False, [
        turn(state=raw, next_state=raw.replace("__P_", "_P__"), prediction=raw.replace("__P_", "_P__")),
        turn(state=coords, next_state=coords, prediction=coords.replace("(3,2)", "(3,1)")),
    ])]
    pred = world_model_metrics(trajectories)["prediction"]
    assert pred["exact_match"] == 0.5 and pred["grid_exact"] == 1.0
    assert pred["coordinates_exact"] == 0.0  # one turn judged: the raw grid's truth has no coordinates


def test_summarize_puts_it_together():
    trajectories = [episode(s, s == 1 and i < 2, [turn()], sample=i) for s in (1, 2) for i in range(4)]
    metrics = summarize(trajectories)
    assert metrics["pass@1"] == metrics["success_rate"] == pytest.approx(2 / 8)
    assert metrics["pass_at_k"]["4"] == pytest.approx(0.5)
    assert metrics["pass_at_k"]["2"] == pytest.approx((1 - 1 / 6) / 2)
    assert set(metrics["pass_at_k"]) == {"1", "2", "3", "4"}
    assert metrics["world_model"]["observation"]["exact_match"] is None
