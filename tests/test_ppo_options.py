"""PPO's cheaper options: a critic sharing the actor's trunk (`ppo.critic: shared`) and LoRA
adapters (`ppo.lora_rank`). Their passes against the separate networks', the optimizer's learning rates, and whole runs: what
trains, what is saved, what a rollout engine receives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from test_ppo import read_metrics, tiny_config
from test_ppo_packing import PAD, two_groups

from stages import ppo
from stages.common import prefix_tree
from stages.common.errors import UserError
from stages.common.kernels.attention import register_spa_sdpa
from stages.training import engine as eng
from stages.training.policy import StepPolicy, ValueModel
from stages.training.ppo_samples import micro_batches, score


@pytest.mark.parametrize("pack", [False, True])
def test_a_shared_critic_scores_log_probs_and_values_in_one_pass(tokenizer, pack, monkeypatch):
    """One pass of the policy with its value head gives the policy's log-probs and the values a
    separate critic with the same trunk and head gives; packed rows through spa's tree attention,
    as `load_model` sets it up (the placeholder mask alone would pass through stock SDPA)."""
    register_spa_sdpa()
    original, tree_calls = prefix_tree.tree_attention, []

    def counted(*args, **kwargs):
        tree_calls.append(args[3])  # the layout
        return original(*args, **kwargs)

    monkeypatch.setattr(prefix_tree, "tree_attention", counted)
    actor = tiny_model(tokenizer, seed=1).eval()
    policy = StepPolicy(actor, temperature=0.7, value_lr=1e-5)
    critic = ValueModel(actor)  # the same trunk object
    torch.nn.init.normal_(policy.value_head.weight, std=0.5)
    critic.value_head.load_state_dict(policy.value_head.state_dict())
    together, apart = two_groups(len(tokenizer)), two_groups(len(tokenizer))
    with torch.no_grad():
        score(policy, [(m, 1.0) for m in micro_batches(together, 4096, pack)], ("old_logprobs", None, "values"),
              "cpu", PAD, with_values=True)
        score(policy, [(m, 1.0) for m in micro_batches(apart, 4096, pack)], ("old_logprobs",), "cpu", PAD)
        score(critic, [(m, 1.0) for m in micro_batches(apart, 4096, pack)], ("values",), "cpu", PAD)
    for a, b in zip(together, apart, strict=True):
        torch.testing.assert_close(a.old_logprobs, b.old_logprobs, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a.values, b.values, rtol=1e-6, atol=1e-6)
        assert a.values.abs().max() > 0
    assert len(tree_calls) == (3 * 2 if pack else 0)  # three passes of two layers


def test_the_shared_value_head_learns_at_the_critic_rate(tokenizer):
    policy = StepPolicy(tiny_model(tokenizer), temperature=1.0, value_lr=3e-4)
    settings = eng.OptimSettings(1e-6, (0.9, 0.999), 0.0, 1.0, 10, 0.0)
    groups = eng.TorchEngine(policy, settings, "cpu").optimizer.param_groups
    assert [g["lr"] for g in groups] == [1e-6, 3e-4]
    assert groups[1]["params"] == list(policy.value_head.parameters())
    assert len(groups[0]["params"]) == len(list(policy.lm.parameters()))
    plain = eng.TorchEngine(StepPolicy(tiny_model(tokenizer), temperature=1.0), settings, "cpu")
    assert [g["lr"] for g in plain.optimizer.param_groups] == [1e-6]


@pytest.fixture(scope="module")
def lora_shared_run(tiny_model_dir, tmp_path_factory):
    """2 steps with LoRA (rank 4) on the actor and a critic sharing its trunk, on DeepSpeed ZeRO-2."""
    out = tmp_path_factory.mktemp("ppo-lora") / "run"
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.lora_rank=4", "ppo.lora_alpha=8", "ppo.critic=shared"))
    return out


def test_lora_with_a_shared_critic_trains_low_rank_deltas_and_saves_plain_models(lora_shared_run, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = lora_shared_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["value_loss"] > 0 and row["logp_diff"] < 1e-3  # the rollouts ran the adapted weights
        assert "actor_grad_norm" in row and "critic_grad_norm" not in row  # one engine
    state = out / "trainer_state"
    assert (state / "actor").exists() and not (state / "critic").exists()
    trained = AutoModelForCausalLM.from_pretrained(out / "final")  # a plain model: adapters merged
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert trained.state_dict().keys() == initial.state_dict().keys()
    changed = 0
    for name, weight in trained.state_dict().items():
        delta = weight - initial.state_dict()[name]
        if name.endswith("proj.weight"):  # every linear layer of the blocks: a rank <= 4 change
            changed += int(delta.abs().max() > 0)
            assert torch.linalg.matrix_rank(delta, atol=1e-6) <= 4, name
        else:  # embeddings and norms stay frozen
            assert torch.equal(delta, torch.zeros_like(delta)), name
    assert changed == 2 * 7  # 2 layers x q, k, v, o, gate, up, down


def test_lora_with_a_shared_critic_resumes_to_the_uninterrupted_weights(lora_shared_run, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    settings = ("ppo.lora_rank=4", "ppo.lora_alpha=8", "ppo.critic=shared")
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.steps=1", *settings))
    ppo.run(tiny_config(tiny_model_dir, out, "ppo.resume=true", *settings))
    resumed, whole = load_file(out / "final" / "model.safetensors"), load_file(lora_shared_run / "final" / "model.safetensors")
    for name, weight in whole.items():
        torch.testing.assert_close(resumed[name], weight, rtol=0, atol=1e-6)
    assert json.loads((out / "trainer_state" / "progress.json").read_text())["step"] == 2


def test_a_vllm_engine_receives_the_merged_lora_weights_under_the_base_names(tiny_model_dir, tmp_path):
    """With LoRA the rollout engine gets base + adapter delta for every weight, named as in the
    checkpoint it loaded (no base_layer / lora_ keys)."""
    from transformers import AutoModelForCausalLM

    from stages.training.checkpoints import merged_lora_state_dict

    config = tiny_config(tiny_model_dir, tmp_path / "run", "ppo.lora_rank=4", "ppo.zero_stage=0",
                         "rollout.backend=vllm")
    models = ppo.build_models(config)
    with torch.no_grad():  # move the adapters off their zero start
        for name, param in models.actor.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)

    class Engine:
        def load_weights(self, weights):
            self.received = {name: tensor.clone() for name, tensor in weights}

    engine = Engine()
    ppo.push_weights(models, engine, config)
    expected = merged_lora_state_dict(models.actor)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert engine.received.keys() == expected.keys() == plain.keys()
    for name, tensor in expected.items():
        assert torch.equal(engine.received[name], tensor)
    assert not torch.equal(engine.received["model.layers.0.self_attn.q_proj.weight"],
                           plain["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("overrides, message", [
    (["ppo.critic=shared", "ppo.advantage=grpo"], r"ppo.critic=shared puts a value head on the actor, and ppo"),
    (["ppo.lora_rank=8", "ppo.zero_stage=3"], r"ppo.lora_rank > 0 .* use ppo.zero_stage 0-2"),
])
def test_options_that_cannot_combine_are_refused_in_one_line(tiny_model_dir, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message) as info:
        ppo.run(tiny_config(tiny_model_dir, tmp_path / "run", *overrides))
    assert "\n" not in str(info.value)
    assert not Path(tmp_path / "run").exists()
