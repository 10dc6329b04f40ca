"""One decode step of a Llama-family model, run as one loop over its layers on the model's own weights.

transformers runs a generated token through a tree of modules: per layer a dozen module calls,
each norm six operators, each rotary embedding seven per tensor, a mask built per call, keyword
arguments threaded through every level. On a CPU, where a small model's decode step takes tens of
milliseconds, that machinery and those operators are a large share of the step beside the
products and attention kernels (docs/results.md, *The engine's ceiling*). `DecodeStep` computes
the same step with the same weights and kernels as a flat loop:

* the norms as `torch.nn.functional.rms_norm`, one call each;
* the rotary embedding as ``x * cos + roll(x) * signed_sin``, the halves swapped by one ``roll``
  and the sign folded into the sine once per step, not per layer;
* the linear layers through each module's ``forward`` as it stands, which inside
  `stages.common.kernels.linear.PackedLinears.active` is the oneDNN product on the reordered
  weight, and transformers' own elsewhere;
* attention through the function the model registered as "sdpa" (`attention.spa_sdpa`), with the
  cache's shared columns, so each step reads what the model's own forward would read; the mask made
  additive once per step, not once per layer.

It applies to the classes named in `ARCHITECTURES` (Llama, Mistral, Qwen2: pre-norm decoder
layers, SiLU-gated MLP, rotary embeddings, no score extras; full attention, which the hf backend
already requires of every model) with SDPA as the attention and no module hooks (but the one
transformers adds for gradient checkpointing); `DecodeStep.applies` says so for a model, and any
other keeps transformers' forward. The hf backend uses it on a CPU only, where it is tested. The
outputs equal that forward's up to float rounding: the rotation is bit for bit transformers', the
fused norm may change the last bits (tests/test_kernels_decode.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.common.kernels.attention import spa_sdpa

#: The transformers classes whose decoder layers `DecodeStep` computes (same module names and maths).
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class DecodeStep:
    """The logits of one new token per row, given the rows' KV cache; see the module docstring."""

    def __init__(self, model):
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm
        self.lm_head = model.lm_head
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling

    @staticmethod
    def applies(model) -> bool:
        """Whether `DecodeStep` computes this model's decode step (see the module docstring). A model
        with hooks on its modules (DeepSpeed ZeRO-3 gathers its weights in them; tools observe
        forwards through them) keeps transformers' forward, which calls them; the one hook
        transformers adds for gradient checkpointing (its embeddings' output made to require
        gradients, which decoding never takes) does not count."""
        config = model.config
        if (type(model).__name__ not in ARCHITECTURES or getattr(config, "_attn_implementation", None) != "sdpa"
                or getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1):
            return False
        checkpointing = getattr(model, "_require_grads_hook", None)
        allowed = {checkpointing.id} if checkpointing is not None else set()
        return not any(set(m._forward_hooks) - allowed or m._forward_pre_hooks for m in model.modules())

    def __call__(self, token: torch.Tensor, position: torch.Tensor, cache, mask: torch.Tensor,
                 shared_columns: int) -> torch.Tensor:
        """``token`` and ``position`` ``[rows, 1]``; ``cache`` a transformers cache whose layers
        ``update`` in place; ``mask`` the boolean ``[rows, 1, 1, columns]`` attention mask after
        this token's column is set. Returns ``[rows, vocab]`` logits."""
        x = self.embed.forward(token)  # [rows, 1, hidden]
        cos, sin = self.rotary(x, position)  # [rows, 1, head_dim]
        half = self.head_dim // 2
        cos, signed_sin = cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), -1)[:, None]
        extra = {}
        if shared_columns:
            extra["shared_columns"] = shared_columns
            # Additive once per step, not once per layer inside `shared_prefix_attention`.
            mask = torch.zeros(mask.shape, dtype=x.dtype).masked_fill_(~mask, float("-inf"))
        rows = token.shape[0]
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = _rms_norm(x, layer.input_layernorm)
            q = _rotated(attn.q_proj.forward(h).view(rows, -1, 1, self.head_dim), cos, signed_sin, half)
            k = _rotated(attn.k_proj.forward(h).view(rows, -1, 1, self.head_dim), cos, signed_sin, half)
            v = attn.v_proj.forward(h).view(rows, -1, 1, self.head_dim)
            keys, values = cache.layers[index].update(k, v)
            out, _ = spa_sdpa(attn, q, keys, values, mask, scaling=self.scaling, **extra)
            x = x + attn.o_proj.forward(out.reshape(rows, 1, -1))
            h = _rms_norm(x, layer.post_attention_layernorm)
            x = x + mlp.down_proj.forward(F.silu(mlp.gate_proj.forward(h)) * mlp.up_proj.forward(h))
        return self.lm_head.forward(_rms_norm(x, self.final_norm))[:, -1]


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)


def _rotated(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, half: int) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``: rotate_half's ``(-x2, x1)`` times ``sin`` is
    ``roll(x)``'s ``(x2, x1)`` times ``signed_sin`` ``(-sin1, sin2)``, bit for bit."""
    return x * cos + x.roll(half, -1) * signed_sin
