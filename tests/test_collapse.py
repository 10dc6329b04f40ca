"""Collapse diagnostics (`stages.evaluation.collapse`) on constructed rollouts: healthy, collapsed into one
repeated token, and collapsed into one template whatever the puzzle; exact values by hand."""

import random

import pytest

from stages.evaluation.collapse import collapse_diagnostics, input_dependence, repeated_ngram_share


def puzzle_response(puzzle: int, sample: int) -> list[int]:
    """A response that names its puzzle (tokens 100 + puzzle..) and varies per sample (a last token)."""
    return [1, 2, 100 + puzzle, 200 + puzzle, 300 + puzzle, 3, 4, 500 + sample]


def test_healthy_rollouts_differ_do_not_repeat_and_depend_on_the_puzzle():
    groups = [g for g in range(4) for _ in range(4)]
    responses = [puzzle_response(g, s) for g in range(4) for s in range(4)]
    figures = collapse_diagnostics(responses, groups)
    assert figures["distinct_in_group"] == 1.0
    assert figures["distinct_responses"] == 1.0
    assert figures["repeated_ngrams"] == 0.0
    # 7 bigrams a response. Same puzzle, other sample: 6 shared of 8 in the union. Other puzzle, same
    # sample: 3 shared ((1,2), (3,4), (4, 500+s)) of 11; other puzzle and sample: 2 shared of 12.
    # Across pairs: 16 x 12 / 2 = 96, of which 16 x 3 / 2 = 24 share the sample.
    across = (24 * 3 / 11 + 72 * 2 / 12) / 96
    assert figures["input_dependence"] == pytest.approx(6 / 8 - across, abs=1e-12)
    assert figures["input_dependence"] > 0.5


def test_a_token_repeated_to_the_limit_shows_in_every_figure():
    groups = [g for g in range(4) for _ in range(4)]
    responses = [[7] * 64 for _ in groups]  # "!!!!!!..." up to max_new_tokens, for every puzzle
    figures = collapse_diagnostics(responses, groups)
    assert figures["distinct_in_group"] == 0.25  # 1 distinct of 4 in each group
    assert figures["distinct_responses"] == 1 / 16
    assert figures["repeated_ngrams"] == 60 / 61  # 61 4-grams a response, all but the first repeat it
    assert figures["input_dependence"] == 0.0


def test_one_template_for_every_puzzle_does_not_depend_on_the_input_even_when_sampled_noisily():
    """Template collapse: the same answer skeleton whatever the puzzle, with sampling noise: responses
    still differ (distinct stays high), but a response to one puzzle is no more like another response
    to it than to a response to another puzzle."""
    rng = random.Random(0)
    groups = [g for g in range(8) for _ in range(4)]
    responses = [[1, 2, rng.randrange(50, 80), 3, 4, rng.randrange(50, 80), 5, rng.randrange(50, 80)] for _ in groups]
    figures = collapse_diagnostics(responses, groups)
    assert figures["distinct_responses"] > 0.9
    # within and across pairs are drawn from the same distribution: their means differ by sampling
    # noise only, far below the healthy rollouts' 0.5
    assert abs(figures["input_dependence"]) < 0.1


def test_repeated_ngrams_counts_repeats_within_a_response_only():
    # [1 2 3 4 1 2 3 4]: 4-grams 1234 2341 3412 4123 1234 -> one repeat of 5
    assert repeated_ngram_share([[1, 2, 3, 4, 1, 2, 3, 4]]) == 1 / 5
    # the same 4-gram in two responses is no repeat
    assert repeated_ngram_share([[1, 2, 3, 4], [1, 2, 3, 4]]) == 0.0
    assert repeated_ngram_share([[1, 2]]) == 0.0  # too short to have a 4-gram


def test_figures_a_batch_cannot_define_are_left_out():
    # one sample a puzzle: no group to compare within
    assert set(collapse_diagnostics([[1, 2], [3, 4]], [0, 1])) == {"distinct_responses", "repeated_ngrams"}
    # one puzzle: no pair across puzzles
    assert set(collapse_diagnostics([[1, 2], [1, 2]], [0, 0])) == {
        "distinct_responses", "repeated_ngrams", "distinct_in_group"}
    with pytest.raises(ValueError):
        input_dependence([[1, 2], [3, 4]], [0, 1])
