"""Linear layers through oneDNN instead of PyTorch's BLAS, on a CPU, for inference and training.

PyTorch computes a float32 ``nn.Linear`` on a CPU with the BLAS it was built with (MKL in the x86
wheels). At the shapes of a small model's generation and training that sgemm runs well below the
machine's peak on some CPUs, AMD's among them, while oneDNN computes the same float32 products
(no lower-precision math is allowed) at two to several times the rate (docs/results.md). Two ways
in:

* `PackedLinears` (generation): a copy of every linear weight reordered once into oneDNN's blocked
  layout, which is what makes the few-row products of decoding fast; inside ``with
  packed.active():`` each layer's forward uses it. The layers a Llama, Mistral or Qwen2 layer
  applies to the same input one after another (its attention's q, k and v projections, its MLP's
  gate and up projections) are packed as one weight, their rows stacked: the first of them computes
  the one product for all and each takes its columns of it: two products a layer where there were
  five, each with a fixed cost beside its arithmetic. The copy is the weights as they were when
  packed: its owner calls `drop()` when they change (the hf backend does so whenever it drops its
  KV caches). It costs as much memory as the linear weights while it is held.
* `onednn_training(model)` (training): inside the with-block each layer's forward and, through
  autograd, its backward (the input's and the weight's gradients) run as oneDNN products on the
  weights as they are: the rows of a training micro-batch are many, so no reordered copy is kept.
  The gradients equal PyTorch's up to float32 rounding (tests/test_kernels_linear.py).

Both apply only where they help and cannot change what is computed: a CPU, PyTorch built with
oneDNN, no autocast (it would have changed the products' dtype), weights in float32 (and, for
generation, bfloat16 where this CPU's oneDNN runs it), no DeepSpeed ZeRO-3 partitioning, and plain
``nn.Linear`` modules (subclasses, e.g. quantized layers, keep their own forward, and so does a
layer whose forward a hook library already wrapped; a LoRA wrapper's base layer is a plain one).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

_ROWS_HINT = 64  # the row count oneDNN lays the weight out for; decode and prefill both run well with it
enabled = True  #: false routes nothing through oneDNN: benchmarks time PyTorch's own kernels beside it


class PackedLinears:
    """oneDNN-reordered copies of a model's linear weights; see the module docstring."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._packed: dict[tuple[nn.Linear, ...], torch.Tensor] = {}  # a group's layers: their stacked weight

    @staticmethod
    def supported(model: nn.Module) -> bool:
        """True where packing applies to this model (see the module docstring)."""
        return _applies(model, (torch.float32, torch.bfloat16) if _onednn_runs_bf16() else (torch.float32,))

    def drop(self) -> None:
        """Forget the copies (the weights changed, or memory is wanted back)."""
        self._packed.clear()

    @contextlib.contextmanager
    def active(self):
        """Route every plain linear layer through its reordered weight for the with-block (packing
        first if needed); a no-op where `supported` is false or autocast is on."""
        if torch.is_autocast_enabled("cpu") or not self.supported(self.model):
            yield
            return
        if not self._packed:
            with torch.no_grad():
                self._packed = {group: torch.ops.mkldnn._reorder_linear_weight(
                    torch.cat([m.weight.detach() for m in group]) if len(group) > 1 else group[0].weight.detach(),
                    _ROWS_HINT) for group in _input_groups(self.model)}
        forwards = {}
        for group, weight in self._packed.items():
            forwards.update(_packed_forwards(group, weight))
        with _routed(forwards):
            yield


@contextlib.contextmanager
def onednn_training(model: nn.Module):
    """Inside the with-block, every plain linear layer of a float32 model on a CPU computes its
    forward and backward products with oneDNN (see the module docstring); elsewhere a no-op."""
    if torch.is_autocast_enabled("cpu") or not _applies(model, (torch.float32,)):
        yield
        return
    with _routed({module: _trainable_forward(module) for module in _plain_linears(model)}):
        yield


class _OneDNNLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` and its gradients as oneDNN products (each ``a @ b.T``)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.with_bias = bias is not None
        return mm_t(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        # Transposed views, not copies: oneDNN reads the strides (no transient copy of a weight).
        if ctx.needs_input_grad[0]:
            grad_x = mm_t(rows, weight.t()).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = mm_t(rows.t(), x.reshape(-1, x.shape[-1]).t())
        if ctx.with_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


def mm_t(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` for 2-D (or, for ``a``, N-D) tensors as one oneDNN product; strided
    views are read as they are."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


def _trainable_forward(module: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        # Decided at each call, not at the with-block's entry: a checkpointed forward recomputes
        # inside the backward's with-block under the autocast its first run had, and must take the
        # path it took then (autocast's bf16 product), or its saved tensors differ in dtype.
        # No rows (a prefix-tree node without trained tokens asks the LM head for none): oneDNN has
        # no primitive for the weight gradient's empty inner dimension.
        if torch.is_autocast_enabled("cpu") or x.numel() == 0:
            return nn.functional.linear(x, module.weight, module.bias)
        return _OneDNNLinear.apply(x, module.weight, module.bias)

    return forward


#: The modules whose forward applies their listed linear layers to one input, one after another
#: (transformers' Llama, Mistral and Qwen2 attention and MLP), which `PackedLinears` packs as one.
INPUT_GROUPS = {("LlamaAttention", "MistralAttention", "Qwen2Attention"): ("q_proj", "k_proj", "v_proj"),
                ("LlamaMLP", "MistralMLP", "Qwen2MLP"): ("gate_proj", "up_proj")}


def _input_groups(model: nn.Module) -> list[tuple[nn.Linear, ...]]:
    """The model's plain linear layers, each alone or with those its module applies to the same input
    (`INPUT_GROUPS`) where they can be one product (same input size, dtype, and all or none with a
    bias)."""
    plain = _plain_linears(model)
    grouped: list[tuple[nn.Linear, ...]] = []
    for module in model.modules():
        for classes, names in INPUT_GROUPS.items():
            layers = tuple(getattr(module, name, None) for name in names)
            if (type(module).__name__ in classes and all(layer in plain for layer in layers)
                    and len({(layer.in_features, layer.weight.dtype, layer.bias is None) for layer in layers}) == 1):
                grouped.append(layers)
    alone = set(plain).difference(*grouped)
    return grouped + [(layer,) for layer in plain if layer in alone]


def _packed_forwards(group: tuple[nn.Linear, ...], weight: torch.Tensor) -> dict:
    """Forwards of a group's layers on their stacked reordered `weight`: the product of an input is
    computed once, by the first layer called on it, and each layer returns its columns of it."""
    if len(group) == 1:
        return {group[0]: lambda x: mm_t(x, weight, group[0].bias)}
    bias = torch.cat([m.bias for m in group]) if group[0].bias is not None else None
    sizes = [m.out_features for m in group]
    held: list = [None, None]  # the input last multiplied (the same object, not an equal one) and its product's parts

    def forward_of(index: int):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if held[0] is not x:
                held[:] = [x, mm_t(x, weight, bias).split(sizes, dim=-1)]
            part = held[1][index]
            if index == len(group) - 1:  # the group's last layer: nothing more to take from it
                held[:] = [None, None]
            return part

        return forward

    return {layer: forward_of(index) for index, layer in enumerate(group)}


@contextlib.contextmanager
def _routed(forwards: dict[nn.Linear, object]):
    """Give each module its forward for the with-block, then the class's back."""
    try:
        for module, forward in forwards.items():
            module.forward = forward
        yield
    finally:
        for module in forwards:
            vars(module).pop("forward", None)


def _plain_linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m)]  # not hook-wrapped


def _onednn_runs_bf16() -> bool:
    """Whether oneDNN computes bfloat16 products on this CPU: it needs AVX512 (BW, VL, DQ) or
    AVX-NE-CONVERT on x86, BF16 on Arm; elsewhere torch refuses its bf16 ops (AVX2-only x86, many
    aarch64 CPUs), and a bf16 model keeps PyTorch's own linear layers."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_enabled() -> bool:
    """Whether spa's CPU kernels may multiply with oneDNN: PyTorch was built with it (its ops exist)
    and `enabled` is on."""
    return enabled and torch.backends.mkldnn.is_available()


def _applies(model: nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    params = list(model.parameters())
    if not params or not onednn_enabled():
        return False
    partitioned = any(hasattr(p, "ds_id") for p in params)  # DeepSpeed ZeRO-3 holds shards only
    return params[0].device.type == "cpu" and params[0].dtype in dtypes and not partitioned
