"""verl's loss aggregations (`stages.training.loss_agg`): closed-form weights, and the aggregate of
a batch summed from its micro-batches equal to the one-batch computation."""

import pytest
import torch
from helpers import aggregate_by_definition

from stages.common.config import load_config
from stages.training import loss_agg

#: seq-mean-token-sum-norm's constant in these tests.
BUDGET = 4


def test_weights_in_closed_form():
    # A micro-batch with sequences of 2 and 3 tokens, out of a batch of 4 sequences and 10 tokens.
    sequence_of = loss_agg.sequence_index([2, 3])
    assert sequence_of.tolist() == [0, 0, 1, 1, 1]
    weights = {mode: loss_agg.token_weights(sequence_of, mode, loss_agg.batch_normalizer(mode, 10, 4, 5)).tolist()
               for mode in loss_agg.LOSS_AGGS}
    assert weights["token-mean"] == pytest.approx([1 / 10] * 5)
    assert weights["seq-mean-token-sum"] == pytest.approx([1 / 4] * 5)
    assert weights["seq-mean-token-mean"] == pytest.approx([1 / 8] * 2 + [1 / 12] * 3)
    assert weights["seq-mean-token-sum-norm"] == pytest.approx([1 / 20] * 5)  # 4 sequences x a budget of 5


@pytest.mark.parametrize("mode", loss_agg.LOSS_AGGS)
def test_micro_batches_sum_to_the_one_batch_aggregate(mode):
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 11, 1, 7, 5]
    losses = [torch.randn(n, generator=generator, dtype=torch.float64) for n in lengths]
    normalizer = loss_agg.batch_normalizer(mode, sum(lengths), len(lengths), BUDGET)
    total = torch.zeros((), dtype=torch.float64)
    for micro in ([0, 1], [2], [3, 4]):  # gradient accumulation; ranks split the same way
        sequence_of = loss_agg.sequence_index([lengths[i] for i in micro])
        total += (torch.cat([losses[i] for i in micro]) * loss_agg.token_weights(sequence_of, mode, normalizer)).sum()
    torch.testing.assert_close(total, aggregate_by_definition(mode, losses, BUDGET))


def test_the_aggregations_weigh_sequences_differently():
    """spa's weights on a batch of a 1-token and a 3-token sequence, against the figures worked by hand."""

    def aggregate(mode, losses):
        sequence_of = loss_agg.sequence_index([len(loss) for loss in losses])
        normalizer = loss_agg.batch_normalizer(mode, len(sequence_of), len(losses), BUDGET)
        return float((torch.cat(losses) * loss_agg.token_weights(sequence_of, mode, normalizer)).sum())

    assert loss_agg.LOSS_AGGS == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    losses = [torch.tensor([1.0]), torch.tensor([0.0, 0.0, 0.0])]
    assert [aggregate(mode, losses) for mode in loss_agg.LOSS_AGGS] == pytest.approx([1 / 4, 1 / 2, 1 / 2, 1 / 8])
    losses = [torch.tensor([2.0]), torch.tensor([1.0, 1.0, 1.0])]
    assert [aggregate(mode, losses) for mode in loss_agg.LOSS_AGGS] == pytest.approx([5 / 4, 3 / 2, 5 / 2, 5 / 8])


def test_the_norm_modes_constant_is_the_stages_sequence_budget():
    config = load_config(None, [])
    assert loss_agg.sequence_budget(config, "sft") == 2048  # sft.max_length
    assert loss_agg.sequence_budget(config, "ppo") == 5 * 400  # rollout.max_turns x rollout.max_new_tokens
    config = load_config(None, ["sft.max_length=512", "rollout.max_turns=2", "rollout.max_new_tokens=96"])
    assert (loss_agg.sequence_budget(config, "sft"), loss_agg.sequence_budget(config, "ppo")) == (512, 192)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq-sum'"):
        loss_agg.batch_normalizer("seq-sum", 10, 4, BUDGET)
