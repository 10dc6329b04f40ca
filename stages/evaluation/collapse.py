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
* ``input_dependence``: how much of what sets two responses to different puzzles apart is gone when
  they answer the same puzzle. With ``d`` the Jaccard distance of two responses' token-bigram sets
  (1 minus their similarity), it is ``1 - mean d within groups / mean d across groups``, which is
  ``(within - across) / (1 - across)`` in mean similarities: the within-group similarity measured
  against the across-group similarity as its baseline, on the scale of what is left above it.
  A cheap stand-in for the mutual information of RAGEN-2 (no extra forward pass, read from the
  text), which like it does not move with the entropy of responses that ignore the puzzle:

  - 0 whenever responses to one puzzle are, on average, no more alike than responses to different
    puzzles, however alike they all are: one template for every puzzle scores 0 whether its samples
    are identical (low entropy) or noisy (high entropy);
  - 1, its maximum, when each puzzle's responses are identical and differ from other puzzles',
    however much text they share across puzzles;
  - unchanged when every distance is scaled by one factor. A longer template that every response
    shares (fewer bits a token) does that when, apart from it, two responses are either identical
    or share no bigram: the same dependence on the puzzle then scores the same at any template
    length, where a plain difference of similarities shrinks with the distances;
  - below 0 only when one puzzle's responses differ more than different puzzles' (sampling noise
    around 0).

  A response with no bigram (empty, or one token) gives no evidence and is left out of the pairs:
  two of them are not alike, they are unmeasured.

A figure that a batch cannot define (no group of two, one group only) is left out; input dependence
is None when its responses leave no pair within a group or across groups to compare.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations, pairwise

#: The n of `repeated_ngrams`: 4 tokens, long enough that ordinary text rarely repeats one.
NGRAM = 4


def collapse_diagnostics(responses: Sequence[Sequence[int]], groups: Sequence[int]) -> dict[str, float | None]:
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


def input_dependence(responses: Sequence[Sequence[int]], groups: Sequence[int]) -> float | None:
    """``(within - across) / (1 - across)``, with `within` and `across` the mean Jaccard similarity of
    the bigram sets of response pairs from the same group and from different groups (the module
    docstring says what it guarantees). Responses without a bigram are left out; None when no pair
    within a group or none across groups is left."""
    bigrams = [frozenset(pairwise(response)) for response in responses]
    comparable = [i for i, grams in enumerate(bigrams) if grams]
    within, across = [], []
    for i, j in combinations(comparable, 2):
        (within if groups[i] == groups[j] else across).append(_jaccard(bigrams[i], bigrams[j]))
    if not within or not across:
        return None
    alike_within, alike_across = _mean(within), _mean(across)
    if alike_across == 1.0:  # every pair across puzzles identical, so every response is: nothing depends on it
        return 0.0
    return (alike_within - alike_across) / (1.0 - alike_across)


def _jaccard(first: frozenset, second: frozenset) -> float:
    return len(first & second) / len(first | second)


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)  # a correctly rounded sum: within 2 ulps of the true mean at any count
