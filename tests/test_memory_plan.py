"""`spa plan` and the memory check of sft, ppo and pipeline (`stages.training.memory`): model states
against closed forms and against DeepSpeed's own estimators, the fits decision and its one line, the
JSON shape, every shipped GPU config fitting one 80 GB GPU, and planning without the network."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spa_cli.main import app
from stages import pipeline, plan, sft
from stages.common.config import load_config, with_overrides
from stages.common.errors import UserError
from stages.common.models import SHIPPED_CONFIGS, config_dir, model_shape
from stages.training import memory
from stages.training.engine import deepspeed_config
from stages.training.memory import GiB, model_states

ROOT = Path(__file__).resolve().parents[1]
GPU_CONFIGS = sorted((ROOT / "configs" / "gpu").glob("*.yaml"))
EASY2HARD = ROOT / "configs" / "gpu" / "frozen_lake_easy2hard_qwen2.5-3b.yaml"
SOKOBAN = ROOT / "configs" / "gpu" / "sokoban_qwen2.5-1.5b.yaml"
H100 = int(memory.DEFAULT_GPU_GIB * GiB)
P = 1_000_000_000  # parameters of the closed-form checks: divisible by every GPU count below


def zero(stage: int, offload: bool = False, gpus: int = 1) -> dict:
    """The "zero_optimization" section the engine builds on CUDA in bf16."""
    return deepspeed_config(stage, offload, 1.0, "cuda", "bf16", "", gpus)["zero_optimization"]


def held(states: memory.Holding) -> int:
    """What DeepSpeed's estimators count on a GPU: weights, gradients, optimizer and the step's copy."""
    return states.weights + states.gradients + states.optimizer + states.step


# ---- model states: closed forms ----------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_leaves_the_fp32_gradients_on_the_gpu(stage):
    """With bf16 weights summed in fp32, DeepSpeed 0.19.8 offloads the optimizer's states but not the
    gradients' first home: ZeRO-2 sums into its compact fp32 partition on the GPU through the backward
    and copies it to the CPU at the step (`copy_grads_in_partition`, `_use_compact_grad_partition_buffer`),
    ZeRO-1 keeps every parameter's fp32 `grad_accum` (`use_grad_accum_attribute`). Read in the
    installed sources, so a DeepSpeed that changes this shows here."""
    import inspect

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    source = inspect.getsource(DeepSpeedZeroOptimizer)
    assert "if self.cpu_offload and self._use_compact_grad_partition_buffer(group_idx):" in source
    assert "if self.use_separate_grad_accum and not self.partition_gradients:" in source
    gpus = 4
    on_gpu = model_states(P, gpus, zero(stage, gpus=gpus))
    offloaded = model_states(P, gpus, zero(stage, offload=True, gpus=gpus))
    assert offloaded.gradients == on_gpu.gradients == (4 * P if stage == 1 else 4 * P // gpus)
    assert (offloaded.optimizer, on_gpu.optimizer) == (0, 12 * P // gpus) and offloaded.cpu == 16 * P // gpus


def test_overlapped_communication_holds_two_reduce_buckets():
    one, several = zero(2, gpus=1), zero(2, gpus=4)
    assert not one["overlap_comm"] and several["overlap_comm"]
    assert model_states(P, 1, one).buckets == 2 * int(one["reduce_bucket_size"])
    assert model_states(P, 4, several).buckets == 2 * 2 * int(several["reduce_bucket_size"])


def test_lora_keeps_its_frozen_base_whole_and_trains_the_adapters_only():
    adapters = 10_000_000
    states = model_states(adapters, 2, zero(2, gpus=2), frozen=P)
    assert states.weights == 2 * (P + adapters)
    assert (states.gradients, states.optimizer) == (4 * adapters // 2, 12 * adapters // 2)


# ---- model states: against DeepSpeed's estimators ------------------------------------------------


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_matches_deepspeeds_estimate(gpus, offload):
    """estimate_zero2_model_states_mem_needs counts, on a GPU, 2P of bf16 weights and 18P/N of bf16
    and fp32 gradients, fp32 master weights and moments; with offload the bf16 weights alone. Summing
    in fp32 (grad_accum_dtype), DeepSpeed >= 0.19.8 allocates no bf16 gradient partition (2P/N less)
    and, offloaded, keeps its fp32 partition on the GPU (4P/N more:
    test_offload_leaves_the_fp32_gradients_on_the_gpu)."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, theirs = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=gpus, cpu_offload=offload)
    # no bf16 partition; with offload the fp32 partition its estimate leaves out
    difference = 4 * P // gpus if offload else -2 * P // gpus
    assert held(model_states(P, gpus, zero(2, offload, gpus))) == theirs + difference


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("offload, offload_params", [(False, False), (True, False), (True, True)])
def test_zero3_matches_deepspeeds_estimate(gpus, offload, offload_params):
    """estimate_zero3_model_states_mem_needs counts 4 bytes of the largest module (gathered) plus
    18P/N, 2P/N with the optimizer offloaded, nothing more with the weights offloaded too; on the
    CPU (ZeRO's zero_init) 16 or 18 bytes a parameter per node, times its buffer factor 1.5."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    largest = 150_000_000
    section = zero(3, offload, gpus)
    if not offload_params:
        section.pop("offload_param", None)
    ours = model_states(P, gpus, section, largest_module=largest)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(P, largest, num_gpus_per_node=gpus, cpu_offload=offload,
                                                        cpu_offload_params=offload_params)
    assert held(ours) == gpu
    if offload:
        assert ours.cpu * gpus * 1.5 == cpu


# ---- model shapes -------------------------------------------------------------------------------


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache (the hub reads its location once, at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model_shape.cache_clear()
    yield tmp_path / "hub"
    model_shape.cache_clear()



def qwen2_params(hidden, layers, heads, kv_heads, intermediate, vocab=151_936):
    """Qwen2's parameters in closed form: tied embeddings; q, k, v with biases, o without; a SwiGLU MLP;
    two RMSNorms a layer and a final one."""
    head_dim = hidden // heads
    attention = hidden * heads * head_dim + heads * head_dim + 2 * (hidden * kv_heads * head_dim + kv_heads * head_dim) \
        + heads * head_dim * hidden
    return vocab * hidden + layers * (attention + 3 * hidden * intermediate + 2 * hidden) + hidden


def llama32_1b_params():
    hidden, layers, kv, head_dim, intermediate, vocab = 2048, 16, 8, 64, 8192, 128_256
    attention = 2 * hidden * hidden + 2 * hidden * kv * head_dim
    return vocab * hidden + layers * (attention + 3 * hidden * intermediate + 2 * hidden) + hidden


@pytest.mark.parametrize("name, expected, published", [
    ("Qwen/Qwen2.5-0.5B-Instruct", qwen2_params(896, 24, 14, 2, 4864), 0.49e9),
    ("Qwen/Qwen2.5-1.5B-Instruct", qwen2_params(1536, 28, 12, 2, 8960), 1.54e9),
    ("Qwen/Qwen2.5-3B-Instruct", qwen2_params(2048, 36, 16, 2, 11008), 3.09e9),
    ("meta-llama/Llama-3.2-1B-Instruct", llama32_1b_params(), 1.24e9),
])
def test_the_papers_models_are_sized_from_the_shipped_configs(name, expected, published, empty_hub_cache):
    assert config_dir(name) == SHIPPED_CONFIGS / name.replace("/", "--")
    shape = model_shape.__wrapped__(name)
    assert shape.params == expected
    assert round(shape.params / 1e7) == round(published / 1e7)  # the model cards' figures
    assert shape.head_params == 0  # tied embeddings: the value head replaces no LM head


def test_a_local_model_directory_is_sized_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text((SHIPPED_CONFIGS / "smollm2-135m" / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert model_shape.__wrapped__(str(tmp_path)).params == model_shape("smollm2-135m").params


def test_the_hub_cache_is_read_before_the_shipped_copy(empty_hub_cache):
    snapshot = empty_hub_cache / "models--Qwen--Qwen2.5-1.5B-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    assert config_dir("Qwen/Qwen2.5-1.5B-Instruct") == snapshot


def test_an_unknown_hub_id_is_one_line_naming_what_to_download(empty_hub_cache):
    with pytest.raises(UserError, match=r"^model someone/unknown-7b: its config\.json is not in the Hugging Face "
                                        r"cache .*hf download someone/unknown-7b config\.json"):
        config_dir("someone/unknown-7b")


def test_the_shipped_configs_are_package_data():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["stages"]
    shipped = sorted(SHIPPED_CONFIGS.glob("*/config.json"))
    assert len(shipped) == 5
    assert all(any(path.relative_to(ROOT / "stages").match(glob) for glob in globs) for path in shipped)


# ---- micro-batches --------------------------------------------------------------------------------


def test_ppo_plans_its_longest_episode_when_the_budget_is_smaller():
    """An episode longer than ppo.micro_batch_tokens goes alone into its micro-batch: the plan counts
    it, as SFT's counts sft.max_length, and halving the budget is not offered where it saves nothing."""
    config = load_config(SOKOBAN, ["ppo.micro_batch_tokens=1024", "ppo.gradient_checkpointing=false"])
    shape = model_shape(config.model.name)
    longest = memory.longest_episode(config)
    assert longest == 768 + 4 * 256 + 5 * 400 > 1024
    small = memory.plan_stage("ppo", config, shape, 1, H100)
    whole = memory.plan_stage("ppo", with_overrides(config, {"ppo.micro_batch_tokens": longest}), shape, 1, H100)
    assert (small.parts["activations"], small.parts["scoring"]) == (whole.parts["activations"], whole.parts["scoring"])
    assert ("ppo.micro_batch_tokens", 512) not in memory._candidates("ppo", config, shape, H100)
    assert ("ppo.micro_batch_tokens", 4096) in memory._candidates("ppo", with_overrides(
        config, {"ppo.micro_batch_tokens": 8192}), shape, H100)


def test_ppo_and_sft_count_the_lm_heads_two_gradients_where_it_trains():
    """PPO's update runs SFT's chunked LM head (`policy.head_logprobs`): a full fine-tune's backward
    holds two head-sized weight gradients beside the activations (a chunk's and its sum with the
    last), 2 x 151,936 x 1,536 x 2 bytes for Qwen2.5-1.5B in bf16 (0.87 GiB), in both; LoRA's
    frozen head has none."""
    config = load_config(SOKOBAN)
    shape = model_shape(config.model.name)
    assert (shape.vocab, shape.hidden, memory._weight_bytes(config)) == (151_936, 1536, 2)
    head_gradients = 2 * 151_936 * 1536 * 2
    for kind, head_bytes in (("ppo", memory.UPDATE_HEAD_BYTES), ("sft", memory.SFT_HEAD_BYTES)):
        section = getattr(config, kind)
        layers_and_head = memory.activations(shape, memory.micro_batch_size(kind, config),
                                             section.gradient_checkpointing, head_bytes)
        full = memory.plan_stage(kind, config, shape, 1, H100)
        lora = memory.plan_stage(kind, with_overrides(config, {f"{kind}.lora_rank": 8}), shape, 1, H100)
        assert full.parts["activations"] == layers_and_head + head_gradients, kind
        assert lora.parts["activations"] == layers_and_head, kind


def test_ppo_plans_the_deepspeed_config_it_runs(tmp_path):
    """A ppo.deepspeed_config whose "stage" is 3 runs ZeRO-3 (the file's stage wins): its lasting
    fp32 gradient partition and buckets are planned as ppo.zero_stage=3's are."""
    path = tmp_path / "zero3.json"
    path.write_text((ROOT / "configs" / "deepspeed" / "zero3.json").read_text())
    shape = model_shape(load_config(SOKOBAN).model.name)
    from_file = memory.plan_stage("ppo", load_config(SOKOBAN, [f"ppo.deepspeed_config={path}"]), shape, 1, H100)
    zero3 = memory.plan_stage("ppo", load_config(SOKOBAN, ["ppo.zero_stage=3"]), shape, 1, H100)
    assert from_file.parts == zero3.parts and from_file.phases == zero3.phases
    assert from_file.parts["buckets"] > 0


@pytest.mark.parametrize("kind", ["sft", "ppo"])
def test_a_deepspeed_config_naming_no_stage_plans_the_zero_stage_set(tmp_path, kind):
    """A user DeepSpeed file without zero_optimization.stage plans ZeRO-2 on 4 GPUs as
    `<kind>.zero_stage=2` does without the file (PPO: 39.4 GiB a GPU of 80; plain torch would plan
    59.5)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"overlap_comm": "auto"}}))
    shape = model_shape(load_config(SOKOBAN).model.name)
    zero2 = load_config(SOKOBAN, [f"{kind}.zero_stage=2"])
    without = memory.plan_stage(kind, zero2, shape, 4, 80 * GiB)
    with_file = memory.plan_stage(kind, with_overrides(zero2, {f"{kind}.deepspeed_config": str(path)}), shape, 4,
                                  80 * GiB)
    assert with_file.parts == without.parts and with_file.phases == without.phases
    assert with_file.parts["buckets"] > 0  # DeepSpeed's reduce buckets: ZeRO, not plain torch
    if kind == "ppo":
        assert round(with_file.need / GiB, 1) == 39.4


# ---- the verdict and its line ---------------------------------------------------------------------


def test_a_stage_fits_up_to_the_last_byte():
    config = load_config(SOKOBAN)  # (SFT: no vLLM, whose share would follow the GPU's size)
    shape = model_shape(config.model.name)
    need = memory.plan_stage("sft", config, shape, 1, H100).need
    assert memory.plan_stage("sft", config, shape, 1, need).fits
    assert not memory.plan_stage("sft", config, shape, 1, need - 1).fits


def test_ppo_phases_add_up_what_is_alive_together():
    config = load_config(SOKOBAN)
    shape = model_shape(config.model.name)
    stage = memory.plan_stage("ppo", config, shape, 1, H100)
    part = stage.parts
    resident = part["weights"] + part["optimizer"] + part["context"]
    assert stage.phases["rollout"] == resident + int(0.3 * H100)  # vLLM's share beside the trainer
    assert stage.phases["scoring"] == stage.phases["rollout"] + part["scoring"]
    # vLLM sleeps during the update; the step's fp32 copy comes after the activations are freed
    assert stage.phases["backward"] == resident + part["gradients"] + part["buckets"] + part["activations"]
    assert stage.phases["optimizer step"] == resident + part["gradients"] + part["step"]
    # actor and critic: tied Qwen, so the critic's value head (hidden + 1) replaces no LM head
    assert part["optimizer"] == 12 * shape.params + 12 * (shape.params + shape.hidden + 1)


def test_kv_cache_gb_still_needs_vllms_share_free_at_start():
    """vLLM's request_memory wants gpu_memory_utilization of the GPU free even when
    kv_cache_memory_bytes sizes the cache (issue 34, fault 9)."""
    config = load_config(SOKOBAN, ["rollout.kv_cache_gb=4", "rollout.gpu_memory_utilization=0.9"])
    stage = memory.plan_stage("ppo", config, model_shape(config.model.name), 1, H100)
    assert stage.peak == "vLLM start" and not stage.fits
    assert stage.phases["vLLM start"] - stage.phases["rollout"] == int(0.9 * H100) - stage.parts["vllm"]


def test_vllm_refuses_a_share_the_gpu_has_not_free_even_with_kv_cache_gb(monkeypatch):
    import torch

    from stages.agent.backends import vllm

    monkeypatch.setattr(vllm, "_memory", lambda device: (30 * GiB, 80 * GiB))  # a trainer holds the rest of 80
    path = str(SHIPPED_CONFIGS / "Qwen--Qwen2.5-1.5B-Instruct")
    with pytest.raises(UserError, match=r"^rollout\.gpu_memory_utilization=0\.6 asks vLLM for 48\.0 GiB but 30\.0 "
                                        r"GiB of the GPU are free .*rollout\.kv_cache_gb or not\); lower it$"):
        vllm.kv_cache_budget(path, "cuda", torch.bfloat16, 4.0, 0.6, 64)
    assert vllm.kv_cache_budget(path, "cuda", torch.bfloat16, 4.0, 0.3, 64).kv_cache_bytes == 4 * GiB


def test_the_3b_recipe_without_offload_is_refused_in_one_line_naming_the_fix():
    config = load_config(EASY2HARD, ["ppo.offload=false"])
    shape = model_shape(config.model.name)
    stage = memory.plan_stage("ppo", config, shape, 1, H100)
    line = memory.too_big(stage, config, shape)
    assert re.fullmatch(r"ppo needs \d+\.\d GiB per GPU of 79\.2; set ppo\.offload=true \(-\d+\.\d GiB\) "
                        r"or run on 2 GPUs", line), line
    saved = float(re.search(r"\(-(\d+\.\d) GiB\)", line).group(1))
    fixed = memory.plan_stage("ppo", with_overrides(config, {"ppo.offload": True}), shape, 1, H100)
    assert fixed.fits and saved == round((stage.need - fixed.need) / GiB, 1)
    assert memory.plan_stage("ppo", config, shape, 2, H100).fits
    # actor and critic alone hold 2 x 14 bytes a parameter: more than the GPU beside anything else
    assert stage.parts["weights"] + stage.parts["optimizer"] == 2 * 14 * shape.params + 14 * (shape.hidden + 1)


def test_settings_are_combined_when_no_single_one_fits():
    config = load_config(SOKOBAN, ["ppo.gradient_checkpointing=false"])
    shape = model_shape(config.model.name)
    stage = memory.plan_stage("ppo", config, shape, 1, 20 * GiB)
    text = memory.fixes("ppo", config, shape, 1, 20 * GiB, other_gpus=False)
    assert not stage.fits and text.startswith("set ppo.offload=true and ppo.gradient_checkpointing=true (-")
    assert memory.plan_stage("ppo", with_overrides(config, {"ppo.offload": True, "ppo.gradient_checkpointing": True}),
                             shape, 1, 20 * GiB).fits


def test_nothing_fits_a_gpu_smaller_than_the_weights():
    config = load_config(SOKOBAN)
    shape = model_shape(config.model.name)
    text = memory.fixes("sft", config, shape, 8, 2 * GiB)
    assert text == "no setting spa plans for makes it fit: use a GPU with more memory, or a smaller model"


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_gpu_config_fits_one_80_gb_gpu(path):
    report = plan.run(load_config(path), gpus=1, gpu_memory_gib=memory.DEFAULT_GPU_GIB)
    assert report.fits, report.error
    kinds = {stage.kind for stage in report.stages}
    assert {"ppo", "eval"} <= kinds and all(stage.fits for stage in report.stages)


# ---- the command --------------------------------------------------------------------------------

runner = CliRunner()


def test_plan_as_json(tmp_path):
    result = runner.invoke(app, ["plan", str(SOKOBAN), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["fits"] is True and report["error"] is None
    assert (report["gpus"], report["gpu_memory_gib"], report["model"]) == (1, 79.2, "Qwen/Qwen2.5-1.5B-Instruct")
    names = [stage["name"] for stage in report["stages"]]
    assert "ppo/spa" in names and "sft/spa" in names and not any(n.startswith("clean/") for n in names)
    assert report["total_gib"] == max(stage["total_gib"] for stage in report["stages"])
    ppo = next(stage for stage in report["stages"] if stage["name"] == "ppo/spa")
    assert set(ppo) >= {"kind", "fits", "total_gib", "peak_phase", "phases", "parts", "cpu_gib"}
    assert ppo["total_gib"] == max(ppo["phases"].values()) and ppo["fits"] is True


def test_a_stage_that_does_not_fit_exits_2_with_one_line():
    result = runner.invoke(app, ["plan", str(EASY2HARD), "--stage", "ppo", "--set", "ppo.offload=false", "--json"])
    assert result.exit_code == 2
    report = json.loads(result.stdout)
    assert report["fits"] is False and report["stages"][0]["fits"] is False
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: ppo needs ") and "set ppo.offload=true" in result.stderr


@pytest.mark.parametrize("args, says", [
    (["--stage", "clean"], "--stage must be one of generate, sft, ppo, eval, got 'clean'"),
    (["--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["--gpu-memory", "-1"], "--gpu-memory must be > 0 GiB, got -1"),
])
def test_bad_plan_flags_are_one_line(args, says):
    result = runner.invoke(app, ["plan", str(SOKOBAN), *args])
    assert result.exit_code == 2 and result.stderr == f"error: {says}\n"


def test_gpus_and_gpu_memory_change_the_plan():
    result = runner.invoke(app, ["plan", str(SOKOBAN), "--stage", "sft", "--gpus", "4", "--gpu-memory", "39.4",
                                 "--json"])
    report = json.loads(result.output)
    assert (report["gpus"], report["gpu_memory_gib"]) == (4, 39.4)
    one = json.loads(runner.invoke(app, ["plan", str(SOKOBAN), "--stage", "sft", "--json"]).output)
    assert report["stages"][0]["parts"]["optimizer"] == pytest.approx(one["stages"][0]["parts"]["optimizer"] / 4,
                                                                      abs=0.01)


# ---- offline ------------------------------------------------------------------------------------


@pytest.fixture
def no_network(empty_hub_cache, monkeypatch):
    """An empty Hugging Face cache, the hub not told to stay offline (as the suite tells it), and
    every connection refused and recorded: whatever reaches for the hub shows in the list."""
    from huggingface_hub import constants

    tried = []

    def refuse(*args, **kwargs):
        tried.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return tried


def test_the_fixture_sees_a_reach_for_the_hub(no_network):
    import huggingface_hub

    with pytest.raises(Exception):  # noqa: B017 - whatever the hub client makes of a refused connection
        huggingface_hub.model_info("someone/unknown-7b")
    assert no_network


def test_a_dry_run_of_the_gpu_recipe_needs_neither_the_network_nor_vllm(no_network, monkeypatch):
    from stages.agent.backends import vllm

    def unwanted(*args, **kwargs):
        raise AssertionError("a dry run sized vLLM's engine")

    monkeypatch.setattr(vllm, "plan_engine", unwanted)
    result = runner.invoke(app, ["pipeline", "--config", str(SOKOBAN), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert no_network == []
    verdicts = re.findall(r"memory +(\d+\.\d) GiB per GPU \((\w[\w ]*)\) of 79\.2: fits", result.output)
    assert len(verdicts) == 16  # every stage of the 8 arms but cleaning


def test_a_cpu_dry_run_says_its_gpu_figures_are_for_a_gpu_it_does_not_have(no_network, monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "gpu_capacity", lambda: None)
    result = runner.invoke(app, ["pipeline", "--config", str(ROOT / "configs" / "demo.yaml"), "--dry-run",
                                 "--set", f"pipeline.dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    stages = re.split(r"\n  (?=\S+/\S+  \[)", result.output)[1:]  # one block per stage
    memory_lines = {block.split()[0]: [line for line in block.splitlines() if line.strip().startswith("memory")]
                    for block in stages}
    assert memory_lines["generate/selfplay"] == []  # random actions: no model, nothing to plan
    assert memory_lines["clean/selfplay"] == []
    planned = [lines for name, lines in memory_lines.items() if name.split("/")[0] in ("sft", "ppo", "eval")]
    assert planned and all(len(lines) == 1 for lines in planned)
    assert all(lines[0].endswith(" of 79.2: fits (planned for one 80 GB GPU; none here)") for lines in planned)


def test_a_dry_run_names_a_stage_that_would_not_fit(no_network):
    result = runner.invoke(app, ["pipeline", "--config", str(EASY2HARD), "--dry-run", "--set", "ppo.offload=false"])
    assert result.exit_code == 2 and no_network == []
    assert "memory   111." in result.stdout or "does not fit" in result.stdout
    assert re.fullmatch(r"error: ppo/vanilla_rl \(and 4 more stages\) needs \d+\.\d GiB per GPU of 79\.2; "
                        r"set ppo\.offload=true \(-\d+\.\d GiB\)\n", result.stderr)


def test_an_unknown_model_fails_at_once_without_the_network(no_network):
    result = runner.invoke(app, ["plan", str(SOKOBAN), "--set", "model.name=someone/unknown-7b"])
    assert result.exit_code == 2 and no_network == []
    assert result.stderr.startswith("error: model someone/unknown-7b: its config.json is not in the Hugging Face")


# ---- the check before a run -----------------------------------------------------------------------


@pytest.fixture
def a_cuda_gpu(monkeypatch):
    """The check's view of an 80 GB GPU, on this CPU machine."""
    from stages.common import models

    for module in (models, pipeline):
        monkeypatch.setattr(module, "pick_device", lambda device="auto": "cuda")
    monkeypatch.setattr(memory, "gpu_capacity", lambda: H100)


def test_sft_and_ppo_refuse_a_stage_too_big_for_the_gpu_before_loading_anything(a_cuda_gpu, tmp_path, monkeypatch):
    config = load_config(EASY2HARD, ["ppo.offload=false", f"ppo.out={tmp_path / 'ppo'}"])
    with pytest.raises(UserError, match=r"^ppo needs .* set ppo\.offload=true .* \(spa plan CONFIG --stage ppo"):
        memory.require_fit(config, "ppo", 1)
    memory.require_fit(with_overrides(config, {"ppo.offload": True}), "ppo", 1)
    small = load_config(EASY2HARD, [f"sft.data={tmp_path / 'missing.jsonl'}", "sft.micro_batch_tokens=2048"])
    tight = with_overrides(small, {"sft.max_length": 32768})
    with pytest.raises(UserError, match=r"^sft needs "):  # refused before the missing data is even looked at
        sft.run(tight)
    with pytest.raises(UserError, match="training data .* does not exist"):
        sft.run(small)


def test_a_cpu_run_is_not_checked(monkeypatch):
    from stages.common import models

    monkeypatch.setattr(models, "pick_device", lambda device="auto": "cpu")
    memory.require_fit(load_config(EASY2HARD, ["ppo.offload=false"]), "ppo", 1)


def test_the_pipeline_refuses_before_its_first_stage(a_cuda_gpu, tmp_path, monkeypatch):
    from stages.agent import backends

    monkeypatch.setattr(backends, "check_backend", lambda *args: None)  # vLLM's own checks are its tests'
    config = load_config(EASY2HARD, ["ppo.offload=false", f"pipeline.dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match=r"^ppo/vanilla_rl \(and 4 more stages\) needs .*; set ppo\.offload=true"):
        pipeline.run(config)
    assert not (tmp_path / "run").exists()


def test_ppo_passes_its_offload_setting_to_both_engines(tiny_model_dir, monkeypatch):
    from stages import ppo
    from stages.training import trainable

    seen = []

    def engine(module, dist, mixed, zero_stage, optim, offload=False, deepspeed_config="", out=None):
        seen.append(offload)
        return object()

    monkeypatch.setattr(trainable, "make_engine", engine)
    config = load_config(None, [f"model.name={tiny_model_dir}", "ppo.zero_stage=0", "ppo.offload=true"])
    ppo.build_models(config)
    assert seen == [True, True]  # actor and critic
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""  # (on the CPU plain torch parks it on disk: test_offload.py)
