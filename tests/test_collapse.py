"""Collapse diagnostics (`stages.evaluation.collapse`) on constructed rollouts: healthy, collapsed into one
repeated token, and collapsed into one template whatever the puzzle; exact values by hand.

Tolerances: a mean of similarities (each below 1) is a correctly rounded sum divided once, within
1.5 x 2^-53 of the true mean; input dependence divides differences of such means by 1 - across, so
its rounding is a few 2^-53 over 1 - across."""

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
    assert figures["input_dependence"] == pytest.approx((6 / 8 - across) / (1 - across), abs=8 * 2**-53 / (1 - across))
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
    assert input_dependence([[1, 2], [3, 4]], [0, 1]) is None


def shared_template(length: int) -> list[int]:
    """A text every response starts with: `length` tokens, 1 to `length`."""
    return list(range(1, length + 1))


def own_text(key: int) -> list[int]:
    """Three tokens of their own for each `key`: two responses with different keys share no bigram here."""
    return [10_000 + 3 * key, 10_001 + 3 * key, 10_002 + 3 * key]


GROUPS = [g for g in range(4) for _ in range(4)]  # 4 puzzles, 4 samples each


def test_responses_as_alike_within_a_puzzle_as_across_puzzles_score_0_at_any_entropy():
    """Template collapse: every response alike (identical), or every response one template with text
    of its own, the template short (much noise a token) or long (little): no pair within a puzzle is
    more alike than a pair across, so nothing depends on the puzzle."""
    assert input_dependence([[5, 6, 7, 8] for _ in GROUPS], GROUPS) == 0.0
    for length in (2, 30):
        responses = [shared_template(length) + own_text(i) for i in range(len(GROUPS))]
        alike = (length - 1) / (length - 1 + 6)  # every pair: the template's bigrams of 3 + 3 of their own each
        assert input_dependence(responses, GROUPS) == pytest.approx(0.0, abs=4 * 2**-53 / (1 - alike)), length


def test_responses_that_depend_on_the_puzzle_alone_score_the_maximum_1():
    """Each puzzle's samples identical, different puzzles' responses different, whatever they share
    across puzzles (here 3 of their 6 bigrams: alike 1/3 across, which a plain difference would subtract)."""
    responses = [[1, 2, 3, 100 + g, 200 + g, 4, 5] for g in GROUPS]
    assert input_dependence(responses, GROUPS) == 1.0
    assert input_dependence([own_text(g) for g in GROUPS], GROUPS) == 1.0  # nothing shared across


def test_the_same_dependence_on_the_puzzle_in_a_longer_shared_template_scores_the_same():
    """Three samples of each puzzle write its own text, the fourth a text of its own; the texts follow a
    template every response shares, none (more bits a token) or 8 tokens (fewer). Half of the pairs
    within a puzzle are identical, the rest and every pair across differ alike: within = (1 + s) / 2,
    across = s, so input dependence is 1/2 at any s, where within minus across, (1 - s) / 2, falls
    from 1/2 to 3/13 with the template."""
    for length, alike in ((0, 0.0), (8, 7 / 13)):  # differing pairs: the template's 7 bigrams of 7 + 3 + 3
        responses = [shared_template(length) + own_text(g if sample < 3 else 100 + 4 * g + sample)
                     for g, sample in zip(GROUPS, [s for _ in range(4) for s in range(4)])]
        assert input_dependence(responses, GROUPS) == pytest.approx(0.5, abs=8 * 2**-53 / (1 - alike)), length


def test_responses_without_a_bigram_are_no_evidence():
    """Empty and one-token responses are left out of the pairs: two of them are not alike, they are
    unmeasured. Added to healthy rollouts they change nothing; alone they give no figure."""
    responses = [puzzle_response(g, s) for g in range(4) for s in range(4)]
    healthy = input_dependence(responses, GROUPS)
    unmeasured = [[], [], [7]]  # each puzzle also gets two empty answers and a one-token one
    padded = [response for g in range(4) for response in responses[4 * g:4 * g + 4] + unmeasured]
    assert input_dependence(padded, [g for g in range(4) for _ in range(7)]) == healthy
    assert collapse_diagnostics([[], [7], [], [9]], [0, 0, 1, 1])["input_dependence"] is None
