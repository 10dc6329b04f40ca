"""bf16 on the CPU, what `model.dtype: bfloat16` runs and what `auto` picks on a CPU with fast bf16.

Training: fp32 weights computing under bf16 autocast. SFT's cross-entropy, PPO's
actor loss (log-probs and entropies) and its critic's value loss backpropagate through the engine
as `spa sft` and `spa ppo` run them: the LM head over several chunks of positions (each
checkpointed and recomputed in the backward), gradient checkpointing off and on, and oneDNN's
training products where the engine computes in fp32. bf16 autocast runs on every x86 CPU
(emulated where the CPU has no bf16 instructions), so these tests run everywhere.

Tolerance: each bf16 rounding moves a tensor by at most u = 2**-8 of its norm (8 significant bits),
and to first order the roundings along a gradient's path add up. On that path: per layer, the
inputs and outputs of its four products groups (q/k/v, attention, o_proj, the MLP's gate/up and
down) rounded in the forward (8) and their gradients in the backward (8); and the head's input,
logits and their gradients (4): 2 * 16 + 4 = 36 roundings. The random model at this init is well
conditioned (no step amplifies a relative error), so each parameter's gradient stays within 36u
of fp32's in norm; a path that skipped autocast, or a wrong gradient, is far outside it.

Generation (`spa eval`, `spa generate`, `spa probe`, PPO's rollouts): the model loaded in bf16,
end to end through the hf backend (the bf16 engine's accuracy against fp32's: tests/test_backends.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import small_llama

from stages import sft
from stages.common.kernels import linear
from stages.training import engine as eng
from stages.training import policy as policy_module
from stages.training.policy import StepPolicy, ValueModel
from stages.training.trainable import enable_checkpointing

VOCAB = 97
CHUNK = 3  # positions per head chunk, forced: 21 scored positions make 7 chunks
SEQUENCE = 24
ROUNDINGS = 2 * 16 + 4
TOLERANCE = ROUNDINGS * 2**-8
SETTINGS = eng.OptimSettings(1e-3, (0.9, 0.95), 0.0, 1.0, 10, 0.0)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(policy_module, "HEAD_CHUNK_BYTES", CHUNK * 4 * VOCAB)


def training_llama(checkpointing: bool):
    """`helpers.small_llama` as the trainers set it up: no KV cache, optional gradient checkpointing."""
    model = small_llama(VOCAB)
    model.config.use_cache = False
    if checkpointing:
        enable_checkpointing(model)
    return model.train()


def batch():
    """One sequence and its 21 scored positions (`stages.sft.token_ce`'s micro-batch)."""
    ids = torch.randint(0, VOCAB, (1, SEQUENCE), generator=torch.Generator().manual_seed(1))
    keep = torch.arange(2, SEQUENCE - 1)
    return {"input_ids": ids, "position_ids": torch.arange(SEQUENCE).unsqueeze(0), "keep": keep,
            "targets": ids[0, keep + 1]}


def sft_loss(engine):
    return sft.token_ce(engine, batch()).sum()


def actor_loss(engine):
    b = batch()
    rows = torch.zeros_like(b["keep"])
    logprobs, entropy, _ = engine(input_ids=b["input_ids"], attention_mask=None, rows=rows, cols=b["keep"],
                                  targets=b["targets"], position_ids=b["position_ids"], with_entropy=True)
    advantages = torch.linspace(-1, 1, len(rows))
    return -(advantages * logprobs).sum() - 0.01 * entropy.sum()


def critic_loss(engine):
    b = batch()
    values = engine(input_ids=b["input_ids"], attention_mask=None, rows=torch.zeros_like(b["keep"]),
                    cols=b["keep"], position_ids=b["position_ids"])
    return 0.5 * ((values - torch.linspace(0, 1, len(values))) ** 2).sum()


NETWORKS = {"sft": (lambda lm: StepPolicy(lm, 1.0), sft_loss),
            "ppo_actor": (lambda lm: StepPolicy(lm, 0.7), actor_loss),
            "ppo_critic": (ValueModel, critic_loss)}


def gradients(network: str, checkpointing: bool, autocast_dtype) -> dict[str, torch.Tensor]:
    """The gradients one micro-batch's loss gives through a plain-torch engine (as `spa sft` /
    `spa ppo` run it with zero_stage 0) computing in `autocast_dtype` (None: fp32)."""
    wrap, loss_of = NETWORKS[network]
    module = wrap(training_llama(checkpointing))
    engine = eng.TorchEngine(module, SETTINGS, "cpu", autocast_dtype=autocast_dtype)
    engine.backward(loss_of(engine))
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["checkpointing-off", "checkpointing-on"])
@pytest.mark.parametrize("network", list(NETWORKS))
def test_bf16_gradients_are_fp32_ones_up_to_bf16_rounding(network, checkpointing):
    bf16 = gradients(network, checkpointing, torch.bfloat16)
    fp32 = gradients(network, checkpointing, None)
    assert bf16.keys() == fp32.keys() and len(fp32) > 10
    for name, expected in fp32.items():
        if expected.norm() == 0:  # e.g. a bias the loss does not reach
            continue
        error = ((bf16[name] - expected).norm() / expected.norm()).item()
        assert error < TOLERANCE, f"{name}: relative error {error:.3g}, bound {TOLERANCE:.3g}"
    assert any(not torch.equal(bf16[name], fp32[name]) for name in fp32)  # the bf16 run did compute in bf16


def test_the_fixture_reaches_the_chunked_head_and_onednns_training_products(monkeypatch):
    """What the test above relies on: the head runs over several chunks (each recomputed in the
    backward) and the fp32 engine computes its products, forward and backward, through oneDNN."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch has no oneDNN: its training products are not taken")
    products = []
    monkeypatch.setattr(linear, "mm_t", lambda *args, mm_t=linear.mm_t: products.append(1) or mm_t(*args))
    lm = training_llama(checkpointing=False)
    heads = []
    lm.get_output_embeddings().register_forward_hook(lambda module, args, out: heads.append(args[0].shape[0]))
    engine = eng.TorchEngine(StepPolicy(lm, 1.0), SETTINGS, "cpu")
    loss = sft_loss(engine)
    forward_products = len(products)
    engine.backward(loss)
    assert heads[-14:] == [CHUNK] * 14  # 7 chunks, each run again in the backward
    assert forward_products > 0 and len(products) > 2 * forward_products


# ---- `spa ppo` end to end in bf16 (`spa sft`: tests/test_sft.py) -----------------------------------


@pytest.mark.parametrize("checkpointing", [False, True], ids=["checkpointing-off", "checkpointing-on"])
def test_spa_ppo_trains_actor_and_critic_in_bf16(tiny_model_dir, tmp_path, monkeypatch, checkpointing):
    """One PPO step of a tiny model in bf16, its head chunked at 8 positions: every micro-batch
    spans several chunks."""
    monkeypatch.setattr(policy_module, "HEAD_CHUNK_BYTES", 8 * 4 * 49152)
    import json

    from stages import ppo
    from stages.common.config import load_config

    out = tmp_path / "ppo"
    config = load_config(None, [
        f"model.name={tiny_model_dir}", "model.dtype=bfloat16", f"ppo.out={out}", "quiet=true",
        "rollout.groups=2", "rollout.group_size=2", "rollout.max_new_tokens=12", "rollout.max_turns=2",
        "ppo.steps=1", "ppo.filter_ratio=1.0", "ppo.mini_batch=2", "ppo.val_every=0", "ppo.val_before_train=false",
        f"ppo.gradient_checkpointing={checkpointing}"])
    ppo.run(config)
    (step,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert step["actor_grad_norm"] > 0 and step["critic_grad_norm"] > 0
    assert all(map(torch.isfinite, (torch.tensor(step["pg_loss"]), torch.tensor(step["value_loss"]))))


# ---- the stages that generate, end to end in bf16 -----------------------------------------------------


def bf16_config(model_dir, *sets):
    from stages.common.config import load_config

    return load_config(None, [f"model.name={model_dir}", "model.dtype=bfloat16", "quiet=true", "env.name=frozen_lake",
                              "rollout.max_new_tokens=8", "rollout.max_turns=2", *sets])


def test_spa_eval_and_spa_generate_play_in_bf16(tiny_model_dir, tmp_path):
    import json

    from stages import evaluate, generate

    report = evaluate.run(bf16_config(tiny_model_dir, f"eval.out={tmp_path / 'eval.json'}", "eval.seeds=3",
                                      "eval.n=2", "eval.pass_k=2"))
    episodes = (tmp_path / "eval.trajectories.jsonl").read_text().splitlines()
    assert len(episodes) == 6 and report["settings"]["n"] == 2
    out = tmp_path / "generated.jsonl"
    generate.run(bf16_config(tiny_model_dir, f"generate.out={out}", "rollout.groups=2", "rollout.group_size=2"))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(row["turns"] and row["turns"][0]["response"] is not None for row in rows)


def test_spa_probe_scores_in_bf16(tiny_model_dir, tmp_path):
    from stages import probe

    report = probe.run(bf16_config(tiny_model_dir, "env.name=sokoban"), tmp_path / "probe.json", states=2)
    assert report["settings"]["dtype"] == "bfloat16"
    assert report["all"]["cases"] > 0 and report["changed"] is not None
