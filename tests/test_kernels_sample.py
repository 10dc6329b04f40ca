"""`stages.common.kernels.native.sample`, a decode step's tokens drawn from its logits by one C call:
the token is the one the float64 cumulative distribution gives at the row's uniform, its
log-probability float64's up to float32 rounding, greedy picks the first maximum as torch.argmax
does, and the hf backend's sampler draws the same tokens with and without it."""

from __future__ import annotations

import pytest
import torch

from stages.agent.backends.base import SamplingParams
from stages.agent.backends.hf import _sample
from stages.common.kernels import native

EPS = torch.finfo(torch.float32).eps
#: The kernel's probabilities against float64's, relative to their total: each exponential within
#: about 2 ulps, its argument's rounding (|a| eps / 2 relative, and |a| e^a <= 1/e), then float32
#: sums of 8 terms a lane and 8 lanes a block (11 additions); blocks add in float64.
CDF_BOUND = 16 * EPS

pytestmark = pytest.mark.skipif(not native.available(), reason="the kernel needs Linux, AVX2 and a C compiler")


def logits_case(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Logits spread as a small model's are (a few likely tokens, a long tail), in `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * 4).to(dtype)


def float64_cdf(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The cumulative distribution of softmax(logits / temperature), normalised, in float64."""
    return torch.softmax(logits.double() / temperature, -1).cumsum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "temperature"), [(49152, 1.0), (1003, 0.7)])  # 1003: a partial block and vector
def test_a_draw_is_the_token_the_float64_distribution_gives_at_its_uniform(dtype, vocab, temperature):
    logits = logits_case(64, vocab, dtype)
    uniforms = torch.rand(64, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = native.sample(logits, temperature, uniforms)
    cdf = float64_cdf(logits, temperature)
    target = uniforms.double()[:, None]
    reference = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Where the uniform falls within the bound of a boundary, either neighbour is right.
    near = ((cdf - target).abs() <= CDF_BOUND).any(-1)
    assert torch.equal(tokens[~near], reference[~near]) and near.sum() <= 1
    exact = torch.log_softmax(logits.double() / temperature, -1).gather(1, tokens[:, None]).squeeze(1)
    assert ((logprobs.double() - exact).abs() <= CDF_BOUND + exact.abs() * EPS).all()


def test_tokens_are_drawn_in_proportion_to_their_probabilities():
    """Uniforms on a regular grid of n points draw each token within one of n times its probability
    (the inverse of the cumulative distribution); a token of probability 0 (logit -inf) never."""
    probabilities = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.0625, 0.0625], dtype=torch.float64)
    logits = probabilities.log().float().repeat(10, 1)  # ten rows of the same distribution
    n = 4000
    counts = torch.zeros(6)
    for start in range(0, n, 10):
        uniforms = (torch.arange(start, start + 10, dtype=torch.float64) + 0.5) / n
        tokens, _ = native.sample(logits, 1.0, uniforms.float())
        counts += torch.bincount(tokens, minlength=6)
    assert counts[3] == 0
    assert ((counts - n * probabilities.float()).abs() <= 1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_the_first_maximum_with_the_untempered_log_probability(dtype):
    logits = logits_case(8, 5003, dtype)
    logits[2, 17] = logits[2, 4001] = logits[2].max() + 1  # a tie: torch.argmax takes the first
    tokens, logprobs = native.sample(logits, 0.0, None)
    assert torch.equal(tokens, logits.argmax(-1)) and tokens[2] == 17
    exact = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None]).squeeze(1)
    assert ((logprobs.double() - exact).abs() <= CDF_BOUND + exact.abs() * EPS).all()


def test_a_strided_row_reads_as_a_contiguous_one():
    wide = logits_case(6, 2 * 777, torch.bfloat16)
    view = wide[:, :777]  # the rows 1,554 elements apart
    uniforms = torch.rand(6, generator=torch.Generator().manual_seed(2))
    assert all(torch.equal(a, b) for a, b in zip(native.sample(view, 1.0, uniforms),
                                                   native.sample(view.contiguous(), 1.0, uniforms)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_backends_sampler_draws_the_same_tokens_with_and_without_the_kernel(monkeypatch, temperature):
    """`_sample` draws its uniforms from the generator either way; the kernel and the operators then
    pick the same tokens (none of these uniforms falls within the bound of a boundary). The
    operators' float32 log-softmax adds the vocabulary's exponentials in 16 lanes (vocab / 16
    additions each, worst case that many ulps), the kernel's is within `CDF_BOUND` of float64's."""
    logits = logits_case(16, 49152, torch.bfloat16, seed=3)
    params = SamplingParams(temperature=temperature)
    ours = _sample(logits, params, torch.Generator().manual_seed(4))
    monkeypatch.setattr(native, "sampling_enabled", False)
    assert native.sample(logits, temperature, None) is None
    theirs = _sample(logits, params, torch.Generator().manual_seed(4))
    assert torch.equal(ours[0], theirs[0])
    assert ((ours[1] - theirs[1]).abs() <= CDF_BOUND + (logits.shape[1] / 16 + theirs[1].abs()) * EPS).all()
