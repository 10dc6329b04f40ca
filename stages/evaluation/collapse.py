"""Collapse diagnostics of a batch of rollouts: do the responses still differ, repeat themselves, and
depend on the puzzle? Pure functions of token-id sequences, logged by every PPO step.

RL on small models is known to stall or collapse into degenerate text: a run whose responses turn
into one repeated token ("!!!!!!", RAGEN #52), or into one template written whatever the puzzle
(RAGEN-2's *template collapse*, measured there as the mutual information between prompt and
response). Reward alone does not show either early. Four figures do, each in [0, 1] except the last:

* ``distinct_in_group``: the share of distinct responses within a group (one puzzle, several
  samples), averaged over groups: 1 when every sample differs, ``1 / group_size`` when a group's
  samples are all the same (then the group has no reward spread to learn from either);
* ``distinct_responses``: the share of distinct responses in the whole batch, across puzzles;
* ``repeated_ngrams``: of all n-grams (``NGRAM`` tokens) in the responses, the share that repeat an
  earlier n-gram of the same response: near 0 for text, near 1 for a token repeated to the limit;
* ``input_dependence``: how much more alike two responses to the same puzzle are than two responses
  to different puzzles (mean Jaccard similarity of their token-bigram sets, within groups minus
  across groups). Responses that describe their puzzle (an observation, coordinates) score well
  above 0; one template for every puzzle scores 0, whether its samples are identical or noisy.
  A cheap stand-in for the mutual information of RAGEN-2: no extra forward pass, read from the text.

A figure that a batch cannot define (no group of two, one group only) is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations, pairwise

#: The n of `repeated_ngrams`: 4 tokens, long enough that ordinary text rarely repeats one.
NGRAM = 4


def collapse_diagnostics(responses: Sequence[Sequence[int]], groups: Sequence[int]) -> dict[str, float]:
    """The four figures of the module docstring for ``responses`` (each episode's sampled token ids,
    all its turns) played on the puzzles ``groups`` (one group id an episode)."""
    if len(responses) != len(groups):
        raise ValueError(f"{len(responses)} responses but {len(groups)} group ids")
    keys = [tuple(response) for response in responses]
    by_group: dict[int, list[tuple[int, ...]]] = {}
    for key, group in zip(keys, groups, strict=True):
        by_group.setdefault(group, []).append(key)
    figures = {"distinct_responses": len(set(keys)) / len(keys), "repeated_ngrams": repeated_ngram_share(keys)}
    if any(len(members) > 1 for members in by_group.values()):
        figures["distinct_in_group"] = _mean([len(set(members)) / len(members) for members in by_group.values()])
        if len(by_group) > 1:
            figures["input_dependence"] = input_dependence(keys, groups)
    return figures


def repeated_ngram_share(responses: Sequence[Sequence[int]], n: int = NGRAM) -> float:
    """Of the n-grams of all ``responses``, the share equal to an earlier n-gram of the same
    response (0 when no response is n tokens long)."""
    total = repeated = 0
    for response in responses:
        grams = [tuple(response[i:i + n]) for i in range(len(response) - n + 1)]
        total += len(grams)
        repeated += len(grams) - len(set(grams))
    return repeated / total if total else 0.0


def input_dependence(responses: Sequence[Sequence[int]], groups: Sequence[int]) -> float:
    """Mean bigram-set similarity of response pairs from the same group minus that of pairs from
    different groups (needs a group of two and two groups)."""
    bigrams = [frozenset(pairwise(response)) for response in responses]
    within, across = [], []
    for i, j in combinations(range(len(responses)), 2):
        (within if groups[i] == groups[j] else across).append(_jaccard(bigrams[i], bigrams[j]))
    if not within or not across:
        raise ValueError("input dependence needs two responses of one group and responses of two groups")
    return _mean(within) - _mean(across)


def _jaccard(first: frozenset, second: frozenset) -> float:
    union = len(first | second)
    return len(first & second) / union if union else 1.0  # two responses too short for a bigram: alike


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
