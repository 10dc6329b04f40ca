"""`stages.common.kernels.decode.DecodeStep`: the decode step computed as one loop over the layers
gives transformers' forward's logits (up to float32 rounding), and the hf backend decodes with it."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from helpers import lively_model
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from stages.agent.backends import GenerationRequest, SamplingParams
from stages.agent.backends.hf import HFBackend
from stages.common.kernels import attention as attention_kernels
from stages.common.kernels import decode, linear, native
from stages.common.kernels.linear import PackedLinears
from stages.common.models import load_tokenizer
from stages.training.trainable import enable_checkpointing

EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def qwen2_model(vocab: int, seed: int = 0, hidden: int = 64, heads: int = 4, kv_heads: int = 2):
    """A 2-layer random Qwen2 (biases on the query, key and value projections), weights scaled up as
    `lively_model`'s are."""
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2, generator=generator)
    return model.eval()


def one_step_both_ways(model, shared: int, reference_shares: bool = True):
    """A 4-row batch (the first `shared` tokens common to all rows, then different lengths, left
    padded) prefilled by the model, then one token decoded by the model's forward and by
    `DecodeStep` from copies of that cache: (reference logits, DecodeStep's logits). The forward
    is told of the shared columns too unless ``reference_shares`` is false (it then reads every
    row's copy of them, through SDPA's kernel)."""
    attention_kernels.register_spa_sdpa()
    rng = random.Random(3)
    common = [rng.randrange(1, 1000) for _ in range(shared)]
    tails = [[rng.randrange(1, 1000) for _ in range(n)] for n in (9, 4, 12, 7)]
    width = max(len(t) for t in tails)
    ids = torch.zeros(4, shared + width, dtype=torch.long)
    mask = torch.zeros(4, shared + width + 1, dtype=torch.bool)
    pos = torch.zeros(4, shared + width, dtype=torch.long)
    for i, tail in enumerate(tails):
        ids[i, :shared] = torch.tensor(common, dtype=torch.long)
        ids[i, shared + width - len(tail):] = torch.tensor(tail)
        mask[i, :shared] = True
        mask[i, shared + width - len(tail):] = True
        pos[i, shared + width - len(tail):] = torch.arange(shared, shared + len(tail))
    pos[:, :shared] = torch.arange(shared)
    extra = {"shared_columns": shared} if shared and reference_shares else {}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, position_ids=pos, attention_mask=mask[:, :-1].long(), past_key_values=cache,
              use_cache=True)
        token = torch.tensor([[11], [22], [33], [44]])
        position = pos[:, -1:] + 1
        mask[:, -1] = True
        step_mask = mask[:, None, None, :]
        reference = model(input_ids=token, position_ids=position, attention_mask=step_mask,
                          past_key_values=copy.deepcopy(cache), use_cache=True, **extra).logits[:, -1]
        ours = decode.DecodeStep(model)(token, position, copy.deepcopy(cache), step_mask, shared)
    return reference, ours


def assert_close_in_float32(reference, ours, layers: int):
    """Within the rounding of a float32 forward: each layer's reordered operations differ by a
    few units of the last place, relative to the logits' size."""
    bound = 64 * layers * EPS * reference.abs().max()
    assert (ours - reference).abs().max() <= bound


@pytest.mark.parametrize("shared", [0, 6])
def test_a_llama_decode_step_gives_the_forwards_logits(tokenizer, shared):
    model = lively_model(tokenizer, heads=4, kv_heads=2)
    model.set_attn_implementation("sdpa")
    assert decode.DecodeStep.applies(model)
    reference, ours = one_step_both_ways(model, shared)
    assert_close_in_float32(reference, ours, 2)
    assert torch.equal(reference.argmax(-1), ours.argmax(-1))


@pytest.mark.parametrize("shared", [0, 6])
def test_a_qwen2_decode_step_with_projection_biases_gives_the_forwards_logits(shared):
    model = qwen2_model(vocab=1000)
    assert decode.DecodeStep.applies(model)
    reference, ours = one_step_both_ways(model, shared)
    assert_close_in_float32(reference, ours, 2)


@pytest.mark.skipif(not native.available(), reason="the native kernel needs Linux, AVX2 and a C compiler")
def test_a_decode_step_through_the_native_attention_gives_sdpas_logits(monkeypatch):
    """With heads of 64 the step's attention over the shared columns is `native.decode_attention`'s
    (tests/test_kernels_native.py builds it wherever it can run); the forward reads every row's
    copy of them through SDPA's kernel."""
    calls = []
    real = native.decode_attention
    monkeypatch.setattr(native, "decode_attention", lambda *args: calls.append(1) or real(*args))
    model = qwen2_model(vocab=1000, hidden=256, heads=4, kv_heads=2)
    reference, ours = one_step_both_ways(model, 6, reference_shares=False)
    assert len(calls) == 2  # one a layer, DecodeStep's only
    assert_close_in_float32(reference, ours, 2)
    assert torch.equal(reference.argmax(-1), ours.argmax(-1))


def test_a_decode_step_on_packed_weights_gives_the_forwards_logits(tokenizer):
    """Inside `PackedLinears.active` the step's products are oneDNN's on the reordered weights."""
    model = lively_model(tokenizer, heads=4, kv_heads=2)
    model.set_attn_implementation("sdpa")
    with PackedLinears(model).active():
        reference, ours = one_step_both_ways(model, 6)
    assert_close_in_float32(reference, ours, 2)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_packed_weights_multiply_a_layers_projections_of_one_input_once(tokenizer, monkeypatch, architecture):
    """Inside `PackedLinears.active` an attention's q, k and v (Qwen2's with their biases) and an
    MLP's gate and up are one oneDNN product each: four products a layer and the LM head's, where
    there were seven a layer; the forward's logits are the stock forward's up to float32 rounding."""
    if not PackedLinears.supported(lively_model(tokenizer)):
        pytest.skip("PyTorch without oneDNN")
    model = lively_model(tokenizer, heads=4, kv_heads=2) if architecture == "llama" else qwen2_model(vocab=1000)
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 8]])
    products = []
    real = linear.mm_t
    monkeypatch.setattr(linear, "mm_t", lambda *args: products.append(1) or real(*args))
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
        with PackedLinears(model).active():
            ours = model(input_ids=ids).logits
    layers = model.config.num_hidden_layers
    assert len(products) == 4 * layers + 1
    assert_close_in_float32(reference, ours, layers)
    assert torch.equal(reference.argmax(-1), ours.argmax(-1))


def test_the_rotation_is_transformers_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 1, 16, generator=generator), torch.randn(3, 2, 1, 16, generator=generator)
    angles = torch.rand(3, 1, 16, generator=generator) * 6
    cos, sin = angles.cos(), angles.sin()
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    signed_sin = torch.cat((-sin[..., :8], sin[..., 8:]), -1)[:, None]
    assert torch.equal(decode._rotated(q, cos[:, None], signed_sin, 8), q_ref)
    assert torch.equal(decode._rotated(k, cos[:, None], signed_sin, 8), k_ref)


def test_a_model_with_hooks_or_another_attention_keeps_transformers_forward_but_checkpointing_does_not(tokenizer):
    model = lively_model(tokenizer)
    model.set_attn_implementation("sdpa")
    assert decode.DecodeStep.applies(model)
    handle = model.model.layers[1].mlp.register_forward_pre_hook(lambda *_: None)
    assert not decode.DecodeStep.applies(model)
    handle.remove()
    handle = model.model.embed_tokens.register_forward_hook(lambda *_: None)
    assert not decode.DecodeStep.applies(model)
    handle.remove()
    enable_checkpointing(model)  # transformers' own hook on the embeddings, which decoding does not need
    assert model.model.embed_tokens._forward_hooks and decode.DecodeStep.applies(model)
    model.set_attn_implementation("eager")
    assert not decode.DecodeStep.applies(model)


def test_the_hf_backend_decodes_every_step_with_it_and_samples_what_transformers_forward_does(tokenizer,
                                                                                               monkeypatch):
    """Every decode step of a CPU call goes through `DecodeStep`, and the sampled tokens and their
    log-probs are those of the same call decoding with transformers' forward (the greedy tokens
    against transformers' own `generate`: tests/test_backends.py)."""
    attention_kernels.register_spa_sdpa()
    model = lively_model(tokenizer, heads=4, kv_heads=2)
    model.set_attn_implementation("sdpa")
    rng = random.Random(4)
    instruction = [rng.randrange(100, 40000) for _ in range(30)]
    requests = [GenerationRequest(f"a{i}", instruction + [rng.randrange(100, 40000) for _ in range(n)])
                for i, n in enumerate([20, 7, 33])]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop=(), seed=7)
    steps = []
    real = decode.DecodeStep.__call__
    monkeypatch.setattr(decode.DecodeStep, "__call__", lambda self, *a: steps.append(a[0].shape[0]) or real(self, *a))
    backend = HFBackend(model, tokenizer)
    ours = backend.generate(requests, params)
    assert len(steps) == backend.stats["decode_steps"] > 0 and steps[0] == 3
    monkeypatch.setattr(decode.DecodeStep, "applies", staticmethod(lambda model: False))
    reference = HFBackend(model, tokenizer).generate(requests, params)
    assert len(steps) == backend.stats["decode_steps"]  # no more steps through it
    for out, ref in zip(ours, reference):
        assert out.token_ids == ref.token_ids
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)  # float32 rounding of the logits
