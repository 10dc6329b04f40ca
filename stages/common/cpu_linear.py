"""Linear layers through oneDNN with reordered weights, for inference on a CPU.

PyTorch computes ``nn.Linear`` on a CPU with the BLAS it was built with (MKL in the x86 wheels).
At the row counts of generation (one to a few hundred tokens a forward) that sgemm runs well below
the machine's peak on some CPUs, AMD's among them, while oneDNN, given the weight once in its own
blocked layout, computes the same product (float32 stays float32: no lower-precision math is
allowed) at several times the rate (docs/results.md). `PackedLinears` keeps such a reordered copy
of every linear weight of a model and, inside ``with packed.active():``, routes each layer's
forward through it.

The copy is the model's weights as they were when packed: its owner calls `drop()` when they
change (the hf backend does so whenever it drops its KV caches). It costs as much memory as the
linear weights themselves while it is held.

Used only where it helps and cannot change what is computed: a CPU, float32 or bfloat16 weights,
PyTorch built with oneDNN, no autocast (which would have changed the product's dtype), and plain
``nn.Linear`` modules (subclasses, e.g. quantized layers, keep their own forward, and so does a
layer whose forward a hook library already wrapped; a LoRA wrapper's base layer is a plain one).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

_ROWS_HINT = 64  # the row count oneDNN lays the weight out for; decode and prefill both run well with it


class PackedLinears:
    """oneDNN-reordered copies of a model's linear weights; see the module docstring."""

    enabled = True  #: benchmarks set it false to time PyTorch's own kernels beside these

    def __init__(self, model: nn.Module):
        self.model = model
        self._packed: dict[nn.Linear, torch.Tensor] = {}

    @staticmethod
    def supported(model: nn.Module) -> bool:
        """True where packing applies to this model (see the module docstring)."""
        params = list(model.parameters())
        if not params or not PackedLinears.enabled or not torch.backends.mkldnn.is_available():
            return False
        first = params[0]
        partitioned = any(hasattr(p, "ds_id") for p in params)  # DeepSpeed ZeRO-3 holds shards only
        return first.device.type == "cpu" and first.dtype in (torch.float32, torch.bfloat16) and not partitioned

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
            self._pack()
        patched = list(self._packed.items())
        try:
            for module, weight in patched:
                module.forward = _packed_forward(weight, module.bias)
            yield
        finally:
            for module, _ in patched:
                del module.forward  # back to the class's forward

    def _pack(self) -> None:
        with torch.no_grad():
            for module in self.model.modules():
                if type(module) is nn.Linear and "forward" not in vars(module):  # not already wrapped (hooks)
                    self._packed[module] = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), _ROWS_HINT)


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return forward
