"""Linear layers through oneDNN (`stages.common.kernels.linear`): packed for generation (the same
products, only while active, never stale) and in training (the same gradients)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import lively_model
from torch import nn

from stages.common.kernels import linear
from stages.common.kernels.linear import PackedLinears, onednn_training

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def small_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 96), nn.SiLU(), nn.Linear(96, 40, bias=False))


def reference(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    return net[2](net[1](net[0](x)))


def rounding_bound(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """What two float32 evaluations of the same net may differ by when they sum in other orders:
    each dot product of length K is within K * eps * sum|x_i w_i| of the exact one (x2 for two
    evaluations), carried through the SiLU (slope <= 1.1) into the second layer."""
    eps = torch.finfo(torch.float32).eps
    first, second = net[0], net[2]
    first_bound = 2 * first.in_features * eps * (x.abs() @ first.weight.abs().T + first.bias.abs())
    hidden = net[1](first(x))
    return (2 * second.in_features * eps * (hidden.abs() @ second.weight.abs().T)
            + 1.1 * first_bound @ second.weight.abs().T)


def test_packed_layers_compute_the_same_products_only_inside_the_block():
    net = small_net()
    x = torch.randn(2, 5, 48)  # a batch of sequences, as a model's layers see them
    packed = PackedLinears(net)
    with torch.inference_mode():
        stock = reference(net, x)
        with packed.active():
            assert all("forward" in vars(m) for m in (net[0], net[2]))
            ours = reference(net, x)
        assert all("forward" not in vars(m) for m in net)  # the class's forward again
    assert ours.shape == stock.shape
    assert ((ours - stock).abs() <= rounding_bound(net, x)).all()


def test_a_dropped_copy_is_packed_again_from_the_current_weights():
    net = small_net()
    x = torch.randn(3, 48)
    packed = PackedLinears(net)
    with torch.inference_mode(), packed.active():
        reference(net, x)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)  # an optimizer step
    packed.drop()
    with torch.inference_mode():
        stock = reference(net, x)
        with packed.active():
            ours = reference(net, x)
    assert ((ours - stock).abs() <= rounding_bound(net, x)).all()


def test_the_layers_get_their_forward_back_when_the_block_raises():
    net = small_net()
    with pytest.raises(RuntimeError, match="inside"), torch.inference_mode(), PackedLinears(net).active():
        raise RuntimeError("inside")
    assert all("forward" not in vars(m) for m in net)


def test_nothing_is_packed_under_autocast_or_for_other_devices_and_dtypes(monkeypatch):
    net = small_net()
    packed = PackedLinears(net)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), packed.active():
        assert reference(net, torch.randn(2, 48)).dtype == torch.bfloat16  # autocast's own product
        assert not packed._packed
    assert not PackedLinears.supported(small_net().double())
    assert not PackedLinears.supported(small_net().to("meta"))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert PackedLinears.supported(small_net().bfloat16())
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not PackedLinears.supported(small_net().bfloat16()) and PackedLinears.supported(small_net())


def test_a_bfloat16_model_generates_on_a_cpu_whose_onednn_has_no_bfloat16(tokenizer, monkeypatch):
    """On such a CPU (AVX2-only x86, many aarch64) torch's oneDNN ops refuse bf16 tensors: the hf
    backend's generation keeps PyTorch's own linear layers and gives their tokens and log-probs."""
    from stages.agent.backends import GenerationRequest, SamplingParams
    from stages.agent.backends.hf import HFBackend

    model = lively_model(tokenizer).to(torch.bfloat16)
    requests = [GenerationRequest(f"e{i}", list(range(500 + i, 530 + 2 * i))) for i in range(3)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop=())

    def generate():
        return [(out.token_ids, out.logprobs) for out in HFBackend(model, tokenizer).generate(requests, params)]

    with monkeypatch.context() as stock:
        stock.setattr(linear, "enabled", False)
        expected = generate()
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        real = getattr(torch.ops.mkldnn, name)
        monkeypatch.setattr(torch.ops.mkldnn, name, refusing_bf16(real))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert generate() == expected


def refusing_bf16(op):
    """`op` as torch has it on a CPU whose oneDNN lacks bf16 (`mkldnn_bf16_device_check`)."""
    def call(*args):
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            raise RuntimeError("mkldnn_linear: bf16 path needs the cpu support avx_ne_convert or avx512bw, "
                               "avx512vl and avx512dq")
        return op(*args)

    return call


def test_only_plain_unwrapped_linear_layers_are_routed():
    class Scaled(nn.Linear):  # a subclass keeps its own forward
        def forward(self, x):
            return 2 * super().forward(x)

    net = nn.Sequential(nn.Linear(8, 8), Scaled(8, 8), nn.Linear(8, 8))
    wrapped = net[2].forward
    net[2].forward = lambda x: wrapped(x) + 1  # a hook library's wrapper stays in place
    with torch.inference_mode(), PackedLinears(net).active():
        assert "forward" in vars(net[0]) and "forward" not in vars(net[1])
        assert net[2].forward.__name__ == "<lambda>"
    assert "forward" not in vars(net[0]) and net[2].forward.__name__ == "<lambda>"


def test_training_through_onednn_gives_pytorchs_gradients():
    """One layer, a 3D batch, a given upstream gradient U: the output x W^T + b, and the gradients
    U W (input), U^T x (weight) and the sum of U (bias) each within what two float32 sums of the
    same n terms in other orders may differ by, 2 n eps times the sum of the terms' magnitudes."""
    torch.manual_seed(1)
    layer = nn.Linear(48, 40)
    x = torch.randn(2, 7, 48, requires_grad=True)
    upstream = torch.randn(2, 7, 40)

    def run(context):
        layer.zero_grad()
        x.grad = None
        with context:
            out = layer(x)
        out.backward(upstream)
        return out.detach(), x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()

    stock = run(contextlib.nullcontext())
    ours = run(onednn_training(layer))
    assert "forward" not in vars(layer)
    eps = torch.finfo(torch.float32).eps
    w, b, u, xs = layer.weight.detach().abs(), layer.bias.detach().abs(), upstream.abs(), x.detach().abs()
    rows = u.reshape(-1, 40), xs.reshape(-1, 48)
    bounds = (2 * 48 * eps * (xs @ w.T + b),  # output: sums over in_features
              2 * 40 * eps * (u @ w),  # input gradient: sums over out_features
              2 * 14 * eps * (rows[0].T @ rows[1]),  # weight gradient: sums over the 14 rows
              2 * 14 * eps * rows[0].sum(0))  # bias gradient
    for name, a, b_, bound in zip(("output", "input grad", "weight grad", "bias grad"), ours, stock, bounds):
        assert a.shape == b_.shape and ((a - b_).abs() <= bound).all(), name


def test_training_through_onednn_skips_frozen_weights_and_autocast():
    net = small_net(2)
    net[0].weight.requires_grad_(False)  # a LoRA base weight
    x = torch.randn(5, 48)
    with onednn_training(net):
        assert "forward" in vars(net[0])
        reference(net, x).sum().backward()
    assert net[0].weight.grad is None and net[0].bias.grad is not None and net[2].weight.grad is not None
    with torch.autocast("cpu", dtype=torch.bfloat16), onednn_training(net):
        assert all("forward" not in vars(m) for m in net)


def test_training_through_onednn_takes_no_rows():
    """A layer asked for no rows (the LM head of a prefix-tree node without trained tokens): an
    empty output, and zero weight and bias gradients (oneDNN has no primitive for the weight
    gradient's empty inner dimension: PyTorch's product computes it)."""
    layer = nn.Linear(48, 40)
    x = torch.randn(0, 48, requires_grad=True)
    with onednn_training(layer):
        out = layer(x)
        (out.sum() + layer.weight.sum()).backward()
    assert out.shape == (0, 40)
    assert torch.equal(layer.weight.grad, torch.ones(40, 48)) and torch.equal(layer.bias.grad, torch.zeros(40))
