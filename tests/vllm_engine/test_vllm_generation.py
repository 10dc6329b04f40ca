"""The vllm backend against the hf backend and the trainer, on the bundled model (fp32, CPU).

One engine for the file (the bundled SmolLM2-135M through `make_backend`, default settings but a
batch of 16). The hf backend is the reference: both must play the same greedy episodes, token for
token across turns, stop for the same reasons, and vLLM's log-probs of sampled tokens must be the
trainer's (`StepPolicy`, what PPO's `logp_diff` compares).
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from stages.agent.backends import GenerationRequest, SamplingParams, make_backend
from stages.agent.backends.base import all_singles
from stages.agent.backends.hf import HFBackend
from stages.agent.proxy import play
from stages.common.config import ModelConfig, load_config
from stages.common.models import load_model
from stages.training.policy import StepPolicy
from stages.training.ppo_samples import micro_batches, score, system_prompt_length, to_sample

MODES = {"prompt_mode": "world_model", "render_mode": "coords"}  # what `spa generate` plays


def rollout_config(*sets: str):
    return load_config(None, ["rollout.max_turns=2", "rollout.max_new_tokens=48", "rollout.batch_size=16",
                              "quiet=true", *sets])


@pytest.fixture(scope="module")
def engine(tokenizer):
    config = rollout_config("rollout.backend=vllm")
    backend = make_backend(config.model, config.rollout, prompt_mode="world_model", tokenizer=tokenizer)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def hf():
    model, _ = load_model(ModelConfig(device="cpu", dtype="float32"))
    return model.eval()


@pytest.fixture(scope="module")
def hf_backend(hf, tokenizer):
    return HFBackend(hf, tokenizer, batch_size=16)


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_dict=False)


def test_the_engine_runs_where_vllm_found_its_device(engine, vllm_device):
    assert engine.device == vllm_device and engine.max_model_len >= 4096


def test_the_engine_plays_as_many_episodes_at_once_as_its_kv_cache_holds(engine, vllm_device):
    """On a CPU the automatic KV cache holds rollout.batch_size (16) conversations of 4096 tokens;
    on a GPU its size is vLLM's (what gpu_memory_utilization leaves), read after the start."""
    scheduler = engine.llm.llm_engine.vllm_config.scheduler_config
    if vllm_device == "cpu":
        assert engine.concurrency == scheduler.max_num_seqs == 16
    else:
        assert 1 <= engine.concurrency <= scheduler.max_num_seqs


def test_the_same_episodes_whatever_the_engines_concurrency(engine, monkeypatch):
    """Each request samples from its own seed: waves of 2 or one wave of 6 play the same episodes,
    which is what makes a launched run's ranks play one process's episodes."""
    config = rollout_config()
    played = []
    for concurrency in (2, 6):
        monkeypatch.setattr(engine, "concurrency", concurrency)
        played.append(play(config.env, config.rollout, engine, [400, 401, 402], 2, **MODES))
    assert [e.token_ids for e in played[0]] == [e.token_ids for e in played[1]]
    assert len({tuple(e.token_ids) for e in played[1]}) == 6  # sampled: every episode differs


def test_greedy_episodes_equal_the_hf_backends_token_for_token(engine, hf_backend):
    """Two turns of Sokoban at temperature 0: the same completions, hence the same games and the
    same token sequences (prompt, completion, environment reply, next completion)."""
    config = rollout_config("rollout.temperature=0")
    seeds = [123, 124, 125, 126]
    ours = play(config.env, config.rollout, engine, seeds, 1, **MODES)
    reference = play(config.env, config.rollout, hf_backend, seeds, 1, **MODES)
    assert sum(len(e.turns) for e in ours) > len(seeds)  # some episodes reached their second turn
    for a, b in zip(ours, reference):
        assert [t.response for t in a.turns] == [t.response for t in b.turns]
        assert a.token_ids == b.token_ids and a.response_mask == b.response_mask
        assert [t.finish_reason for t in a.turns] == [t.finish_reason for t in b.turns]


def test_sampled_logprobs_are_the_trainers(engine, hf, tokenizer, record_property):
    """PPO's check: the trainer's log-prob of each sampled token (at the sampling temperature) is
    the one vLLM reported."""
    config = rollout_config()
    episodes = play(config.env, config.rollout, engine, [200, 201], 4, **MODES)
    assert len({tuple(e.token_ids) for e in episodes[:4]}) > 1  # a group's samples differ
    system = system_prompt_length(tokenizer, episodes[0].token_ids)
    samples = [to_sample(e, "assistant", system) for e in episodes]
    with torch.no_grad():
        score(StepPolicy(hf, config.rollout.temperature), [(micro, 1.0) for micro in micro_batches(samples, 4096)],
              ("old_logprobs",), "cpu", tokenizer.pad_token_id)
    diffs = torch.cat([(s.old_logprobs - s.sampler_logprobs)[s.sampled].abs() for s in samples])
    record_property("figure: vLLM-CPU fp32 mean |logp trainer - logp vLLM| over sampled tokens",
                    f"{float(diffs.mean()):.2e} (max {float(diffs.max()):.2e}, {len(diffs)} tokens)")
    assert len(diffs) > 200 and float(diffs.mean()) < 1e-4 and float(diffs.max()) < 1e-2


def test_eos_stop_string_and_length_end_a_completion_as_in_the_hf_backend(engine, hf_backend, tokenizer):
    ids = chat_ids(tokenizer, "Name three colors.")
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, stop=())
    request = [GenerationRequest("a", ids)]
    eos = engine.generate(request, greedy)[0]
    assert eos.finish_reason == "eos" and eos.token_ids[-1] in engine.eos_ids and len(eos.token_ids) < 40
    assert "<|im_end|>" not in eos.text
    word = eos.text.split()[len(eos.text.split()) // 2]  # a word in the middle of the answer
    cases = {"eos": greedy, "length": dataclasses.replace(greedy, max_new_tokens=4),
             "stop": dataclasses.replace(greedy, stop=(word,))}
    for reason, params in cases.items():
        ours, reference = engine.generate(request, params)[0], hf_backend.generate(request, params)[0]
        assert (ours.finish_reason, ours.token_ids, ours.text) == (reason, reference.token_ids, reference.text)
    assert len(engine.generate(request, cases["length"])[0].token_ids) == 4
    stopped = engine.generate(request, cases["stop"])[0]
    assert stopped.text.endswith(word) and stopped.text.count(word) == 1  # the stop string is kept, then it ends


def test_each_turn_extends_the_last_prompt_with_the_sampled_tokens(engine, tokenizer):
    """Token-in/token-out: a turn's prompt is the previous prompt, the exact tokens vLLM returned,
    then the environment's reply; nothing is re-tokenized."""
    calls = []

    class Recording:
        name, tokenizer = engine.name, engine.tokenizer

        def generate(self, requests, params, progress=None):
            completions = engine.generate(requests, params, progress)
            singles = all_singles(requests)
            calls.append({r.key: (r.prompt_ids, c) for r, c in zip(singles, completions)})
            return completions

        def release(self, keys):
            engine.release(keys)

    config = rollout_config("rollout.max_turns=3", "rollout.max_new_tokens=32")
    episodes = play(config.env, config.rollout, Recording(), [300, 301], 2, **MODES)
    extended = 0
    for earlier, later in itertools.pairwise(calls):
        for key, (prompt, _) in later.items():
            before, sampled = earlier[key]
            assert prompt[:len(before) + len(sampled.token_ids)] == before + sampled.token_ids
            extended += 1
    assert extended > 0
    for episode in episodes:
        for (start, end), turn in zip(episode.turn_spans, [c[episode.id][1] for c in calls if episode.id in c]):
            assert episode.token_ids[start:end] == turn.token_ids and episode.logprobs[start:end] == turn.logprobs


def test_each_request_samples_from_its_own_seed_and_leaves_the_callers_generators_alone(engine, tokenizer):
    prompt = chat_ids(tokenizer, "Tell me a story.")
    requests = [GenerationRequest(f"k{i}", prompt, seed=i) for i in range(4)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, stop=())
    torch.manual_seed(123)
    random.seed(5)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    first = [c.token_ids for c in engine.generate(requests, params)]
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    assert len({tuple(ids) for ids in first}) == 4  # one prompt, four seeds, four samples
    assert [c.token_ids for c in engine.generate(requests, dataclasses.replace(params, seed=8))] == first
    # a request's sample is its own: alone, or reversed among others in a larger call
    assert [engine.generate([r], params)[0].token_ids for r in requests[:2]] == first[:2]
    other = GenerationRequest("other", chat_ids(tokenizer, "Count to ten."), seed=9)
    assert [c.token_ids for c in engine.generate([other, *requests[::-1]], params)][1:] == first[::-1]
    reseeded = [dataclasses.replace(r, seed=r.seed + 10) for r in requests]
    assert [c.token_ids for c in engine.generate(reseeded, params)] != first


class Singles:
    """The engine, sent each n-request as its lone requests (`GenerationRequest.singles`); records
    the keys of each call's requests as they came."""

    def __init__(self, engine, split: bool):
        self.engine, self.split, self.calls = engine, split, []
        self.name, self.tokenizer = engine.name, engine.tokenizer

    def generate(self, requests, params, progress=None):
        self.calls.append([r.keys for r in requests])
        if self.split:
            requests = all_singles(requests)
        return self.engine.generate(requests, params, progress)

    def release(self, keys):
        self.engine.release(keys)


def test_an_n_request_draws_what_its_lone_requests_draw(engine, tokenizer):
    """vLLM seeds the i-th sample of SamplingParams(n=...) with seed + i: an n-request's samples
    are those of the requests `singles()` makes, token for token, and their log-probs up to the
    rounding of batched kernels (fp32: about 1e-5 here; 1e-3 leaves room)."""
    request = GenerationRequest("a", chat_ids(tokenizer, "Tell me a story."), seed=41,
                                more_keys=("b", "c", "d"))
    params = SamplingParams(max_new_tokens=16, temperature=1.0, stop=())
    together = engine.generate([request], params)
    alone = [engine.generate([single], params)[0] for single in request.singles()]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    for ours, lone in zip(together, alone):
        assert ours.logprobs == pytest.approx(lone.logprobs, abs=1e-3)
    assert len({tuple(c.token_ids) for c in together}) == 4  # four independent draws
    assert [c.token_ids for c in engine.generate([request], params)] == [c.token_ids for c in together]
    greedy = dataclasses.replace(params, temperature=0.0)
    assert [c.token_ids for c in engine.generate([request], greedy)] == \
        [engine.generate([GenerationRequest("e", request.prompt_ids)], greedy)[0].token_ids] * 4


def test_a_puzzles_samples_start_with_one_n_request_and_play_on_as_lone_requests_would(engine):
    """Eval's n samples of a puzzle: one request on the first turn, one per episode after it; the
    episodes are those of lone requests, turn for turn, and the same when played again."""
    config = rollout_config()
    played = {}
    for split in (False, True):
        backend = Singles(engine, split)
        played[split] = play(config.env, config.rollout, backend, [500, 501], 4, **MODES)
        assert backend.calls[0] == [tuple(f"sokoban-{seed}-{sample}" for sample in range(4)) for seed in (500, 501)]
        assert all(len(keys) == 1 for call in backend.calls[1:] for keys in call)
        assert len(backend.calls) == 2  # two turns: the second one request per episode still going
    assert sum(len(e.turns) for e in played[False]) > len(played[False])  # some episodes played a second turn
    for ours, alone in zip(played[False], played[True]):
        assert ours.token_ids == alone.token_ids and ours.logprobs == pytest.approx(alone.logprobs, abs=1e-3)
        assert [t.response for t in ours.turns] == [t.response for t in alone.turns]
    assert len({e.turns[0].response for e in played[False][:4]}) > 1  # a puzzle's samples differ
    again = play(config.env, config.rollout, engine, [500, 501], 4, **MODES)
    assert [e.token_ids for e in again] == [e.token_ids for e in played[False]]
