"""What spa asks of vLLM's worker, as methods vLLM mixes into its worker class.

`VLLMBackend` starts its engine with ``worker_extension_cls`` naming `WorkerExtension`, and calls
these methods by name through ``LLM.collective_rpc``. A name travels wherever the worker runs (in
this process, or in vLLM's engine process); a Python function does not: vLLM's serializer refuses
to send code to another process.

vLLM imports this module inside its worker processes: it imports nothing of spa.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class WorkerExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker."""

    def spa_stage_weights(self, saved: bytes) -> None:
        """Keep a part of the weights (a list of names and tensors in torch's file format) for the
        next `spa_load_weights(None)`: an engine in another process receives them in parts of
        bounded size. Read with ``weights_only``: the bytes cannot run code here."""
        import io

        import torch

        if not hasattr(self, "spa_staged"):
            self.spa_staged = []
        self.spa_staged.extend(torch.load(io.BytesIO(saved), weights_only=True))

    def spa_load_weights(self, weights: Iterable[tuple[str, Any]] | None) -> list[str]:
        """Load updated weights (Hugging Face parameter names and tensors; None: those staged)
        into the engine's model through vLLM's own in-place reload (`Worker.reload_weights`: the
        model's `load_weights`, which takes them one by one and processes each layer once its
        weights are in, as after a load from disk; on CPUs that repacks the weights for its matmul
        kernels). Returns the engine parameters that received nothing: [] when every one was loaded.

        A layer whose weights are another layer's (a tied LM head) receives no weights of its own,
        so vLLM's reload skips its processing and, on a CPU, its matmul would keep the packed copy
        of the old embeddings; it is processed again here from the updated, shared weights."""
        if weights is None:
            weights, self.spa_staged = getattr(self, "spa_staged", []), []
        model = self.model_runner.get_model()
        expected = {name for name, _ in model.named_parameters()}
        tied = _tied_layers(model)
        loaded: set[str] = set()
        load = model.load_weights

        def recording(weights_iterator):  # vLLM's reload drops the set of names load_weights returns
            names = load(weights_iterator)
            loaded.update(names or ())
            return names

        model.load_weights = recording
        try:
            self.reload_weights(weights_iterator=weights)
        finally:
            del model.load_weights
        for layer in tied:
            layer.quant_method.process_weights_after_loading(layer)
        return sorted(expected - loaded)


def _tied_layers(model) -> list:
    """Layers with a weight-processing method whose parameters belong to another layer (listed
    under that layer's name: `named_parameters` names a shared parameter once)."""
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        for parameter in module.parameters(recurse=False):
            owner.setdefault(id(parameter), name)
    return [module for name, module in model.named_modules()
            if hasattr(getattr(module, "quant_method", None), "process_weights_after_loading")
            and any(owner[id(p)] != name for p in module.parameters(recurse=False))]
