"""`spa sft`: loss masks, batching, the training loop, checkpoints, resume, DeepSpeed, bad input."""

from __future__ import annotations

import copy
import itertools
import json
import random
import re
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import aggregate_by_definition, live_modules

from stages import sft
from stages.common.config import load_config
from stages.common.errors import UserError
from stages.common.models import load_tokenizer
from stages.training import loss_agg
from stages.training.engine import TorchEngine, cosine_with_warmup, deepspeed_config
from stages.training.policy import StepPolicy
from stages.training.sft_data import (
    Example,
    collate,
    epoch_steps,
    mask_states,
    rank_micro_batches,
    read_rows,
    tokenize_row,
    tokenize_rows,
)

# ---- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama3_tokenizer(tokenizer):
    """A copy of the bundled tokenizer with a Llama-3-style template (trimmed content, header
    tokens, <|eot_id|> closing each turn, a BOS written by the template)."""
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = (
        "{{ '<|begin_of_text|>' }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
        " + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
    return tok


def grid(rng: random.Random) -> tuple[str, str]:
    cells = [["#"] * 5] + [["#", "_", "_", "_", "#"] for _ in range(3)] + [["#"] * 5]
    r, c = rng.randint(1, 3), rng.randint(1, 3)
    cells[r][c] = "P"
    return "\n".join("".join(row) for row in cells), f"Player (P) is at ({r},{c})"


def assistant_text(now: tuple[str, str], nxt: tuple[str, str], action: str = "Up") -> str:
    return (f"<think> <observation>{now[0]}\n{now[1]}</observation> I push right. "
            f"<prediction>{nxt[0]}\n{nxt[1]}</prediction> </think> <answer> {action} </answer>")


def conversation(rng: random.Random, turns: int = 2, train=None) -> list[dict]:
    messages = [{"role": "system", "content": "You are solving Sokoban. Answer with actions."}]
    state = grid(rng)
    for t in range(turns):
        nxt = grid(rng)
        messages.append({"role": "user", "content": f"Turn {t + 1}. State:\n{state[0]}\n{state[1]}."})
        messages.append({"role": "assistant", "content": assistant_text(state, nxt),
                         "train": True if train is None else train[t]})
        state = nxt
    return messages


def write_rows(path: Path, n: int, seed: int = 0, turns: int = 2) -> Path:
    rng = random.Random(seed)
    rows = [{"id": f"r{i}", "source_id": f"s{i}", "env": "sokoban", "seed": i, "success": True,
             "messages": conversation(rng, turns)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_rows(root / "sft.val.jsonl", 2, seed=1, turns=1)
    return write_rows(root / "sft.jsonl", 8, turns=1)  # 2 steps of 4 rows an epoch


def make_config(data, model, out, **sft_values):
    values = {"data": str(data), "out": str(out), "zero_stage": 0, "epochs": 2, "global_batch": 4,
              "lr": 1e-3, "warmup_ratio": 0.0, **sft_values}
    return load_config(None, [], {"model.name": str(model), "quiet": True,
                                  **{f"sft.{k}": v for k, v in values.items()}})


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def trained_runs(example: Example, tok) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs, current = [], []
    for tid, m in zip(example.input_ids, example.mask):
        if m:
            current.append(tid)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


def untrained_roles(example: Example, tok, messages) -> set[str]:
    """Roles whose content characters carry a trained token (should be {'assistant'} only)."""
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tok.apply_chat_template(chat, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"][example.truncated:example.truncated + len(example)]
    regions, cursor = [], 0
    for m in chat:
        start = text.index(m["content"].strip(), cursor)
        regions.append((m["role"], start, start + len(m["content"].strip())))
        cursor = start
    roles = set()
    for (lo, hi), trained in zip(offsets, example.mask):
        for role, start, end in regions:
            if trained and lo < end and hi > start:
                roles.add(role)
    return roles


# ---- masks -------------------------------------------------------------------------------------


def test_masks_on_the_bundled_chatml_template(tokenizer):
    rng = random.Random(3)
    messages = conversation(rng, turns=3, train=[True, False, True])
    example = tokenize_row(tokenizer, messages, max_length=4096)
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    rendered = list(tokenizer.apply_chat_template(chat, tokenize=True)["input_ids"])
    assert example.input_ids == rendered[:len(example)]  # the same tokens, the untrained tail cut
    assert tokenizer.decode(rendered[len(example):]) == "\n"
    expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant" and m["train"]]
    assert trained_runs(example, tokenizer) == expected
    assert untrained_roles(example, tokenizer, messages) == {"assistant"}


def test_masks_on_a_llama3_style_template(llama3_tokenizer):
    tok = llama3_tokenizer
    messages = conversation(random.Random(4), turns=2)
    messages[2]["content"] = "  " + messages[2]["content"] + "\n"  # the template trims it
    example = tokenize_row(tok, messages, max_length=4096)
    assert tok.decode(example.input_ids[:2]) == "<|begin_of_text|><|start_header_id|>"
    expected = [m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant"]
    assert trained_runs(example, tok) == expected
    assert untrained_roles(example, tok, messages) == {"assistant"}


def test_masked_rows_hold_no_state_text_in_input_or_target(tokenizer):
    """The paper's Fig. 4 ablation: every observation and prediction of the assistant turns, the
    trained one and those of the context, is "[MASKED]", which carries no loss."""
    messages = conversation(random.Random(9), turns=3, train=[False, False, True])
    states = [text for m in messages if m["role"] == "assistant"
              for text in re.findall(r"<(?:observation|prediction)>(.*?)</", m["content"], re.DOTALL)]
    assert len(states) == 6
    example = tokenize_row(tokenizer, messages, max_length=4096, state_text="masked")
    text = tokenizer.decode(example.input_ids)
    masked = ("<think> <observation>[MASKED]</observation> I push right. <prediction>[MASKED]</prediction> "
              "</think> <answer> Up </answer>")
    assert re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", text, re.DOTALL) == [masked] * 3
    # the game's own states in the user messages are the observation, and stay
    users = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, re.DOTALL)
    assert users == [m["content"] for m in messages if m["role"] == "user"]
    assistant_text = "".join(re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", text, re.DOTALL))
    assert not any(state in assistant_text for state in states)
    assert "#" not in assistant_text and "Player" not in assistant_text
    # the target: the last turn's tags and text, never the placeholder
    assert trained_runs(example, tokenizer) == [
        "<think> <observation>", "</observation> I push right. <prediction>",
        "</prediction> </think> <answer> Up </answer><|im_end|>"]
    assert mask_states(messages)[0] == messages[0] and mask_states(messages)[2]["content"] == masked
    with pytest.raises(ValueError, match="state_text must be one of trained, masked, placeholder, got 'hidden'"):
        tokenize_row(tokenizer, messages, max_length=4096, state_text="hidden")


def test_placeholder_rows_read_the_masked_text_and_train_the_placeholder(tokenizer):
    """The format control: the same tokens as the masked ablation, the "[MASKED]" tokens trained
    like any other text, and only in the trained turn."""
    messages = conversation(random.Random(9), turns=3, train=[False, False, True])
    control = tokenize_row(tokenizer, messages, max_length=4096, state_text="placeholder")
    masked = tokenize_row(tokenizer, messages, max_length=4096, state_text="masked")
    assert control.input_ids == masked.input_ids
    assert trained_runs(control, tokenizer) == [(
        "<think> <observation>[MASKED]</observation> I push right. <prediction>[MASKED]</prediction> "
        "</think> <answer> Up </answer><|im_end|>")]


def test_no_row_has_an_empty_mask_or_trains_a_user_token(tokenizer, data):
    rows = read_rows(data)
    examples, stats = tokenize_rows(rows, tokenizer, max_length=2048)
    assert stats.kept == len(rows) == len(examples) and stats.dropped_empty == 0
    for example, row in zip(examples, rows):
        assert example.trained > 0
        assert untrained_roles(example, tokenizer, row["messages"]) == {"assistant"}


def test_left_truncation_keeps_the_end_and_untrained_rows_are_dropped(tokenizer):
    messages = conversation(random.Random(6), turns=3)
    full = tokenize_row(tokenizer, messages, max_length=4096)
    cut = tokenize_row(tokenizer, messages, max_length=100)
    assert len(cut) == 100 and cut.truncated == len(full) - 100
    assert cut.input_ids == full.input_ids[-100:]
    assert cut.mask[1:] == full.mask[-99:] and cut.mask[0] == 0
    # only the first turn is trained: the untrained tail goes first, so the truncation keeps it
    early = conversation(random.Random(7), turns=3, train=[True, False, False])
    silent = conversation(random.Random(8), turns=2, train=[False, False])
    rows = [{"id": "keep", "messages": messages}, {"id": "early", "messages": early},
            {"id": "silent", "messages": silent}]
    examples, stats = tokenize_rows(rows, tokenizer, max_length=100)
    assert [e.id for e in examples] == ["keep", "early"]
    assert tokenizer.decode(examples[1].input_ids).endswith(early[2]["content"] + "<|im_end|>")
    assert (stats.truncated, stats.dropped_empty, stats.dropped_ids) == (2, 1, ["silent"])


def test_a_template_that_rewrites_assistant_text_is_an_error(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + "
                         "m['content'].split('</think>')[-1] + '<|im_end|>\n' }}{% endfor %}")
    with pytest.raises(UserError, match="clean --unit turn"):
        tokenize_row(tok, conversation(random.Random(8)), max_length=4096)


# ---- batching ----------------------------------------------------------------------------------


def test_collate_keeps_positions_whose_next_token_is_trained():
    a = Example("a", [10, 11, 12, 13], [0, 0, 1, 1])
    b = Example("b", [20, 21, 22], [0, 1, 0])
    batch = collate([a, b])
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 20, 21, 22]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert batch["keep"].tolist() == [1, 2, 4]
    assert batch["targets"].tolist() == [12, 13, 21]
    assert batch["rows"].tolist() == [0, 0, 1]


def test_collate_shares_the_common_prefix_and_keeps_each_rows_targets():
    a = Example("a", [10, 11, 12, 13], [0, 0, 1, 1])
    b = Example("b", [10, 11, 14], [0, 1, 1])
    c = Example("c", [10, 11, 12], [0, 0, 1])  # a's beginning: computed inside a
    batch = collate([a, b, c], share=True)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 14]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 2]]
    assert batch["layout"].nodes == [(0, 2, -1), (2, 3, 0), (3, 4, 1), (4, 5, 0)]
    assert batch["keep"].tolist() == [1, 2, 0, 1, 1]  # 12 and 13 of a; 11 and 14 of b; 12 of c
    assert batch["targets"].tolist() == [12, 13, 11, 14, 12]
    assert batch["rows"].tolist() == [0, 0, 1, 1, 2]


def test_epoch_plan_and_micro_batches():
    steps = epoch_steps(10, epoch=0, seed=1, global_batch=4)
    assert [len(s) for s in steps] == [4, 4, 2] and sorted(itertools.chain(*steps)) == list(range(10))
    assert steps == epoch_steps(10, 0, 1, 4) and steps != epoch_steps(10, 1, 1, 4)
    lengths = [900, 800, 300, 100, 50]
    examples = [Example(str(i), [i + 1] * n, [0] + [1] * (n - 1)) for i, n in enumerate(lengths)]
    for share in (False, True):
        per_rank = [rank_micro_batches(examples, r, 2, 1000, pack=True, share=share) for r in range(2)]
        assert len(per_rank[0]) == len(per_rank[1])  # ranks stay in step (fillers weigh 0)
        real = sorted(r for mbs in per_rank for mb in mbs if mb.weight for r in mb.rows)
        assert real == list(range(5))
        assert all(sum(lengths[r] for r in mb.rows) == mb.tokens <= 1000 for mbs in per_rank for mb in mbs)
    unpacked = rank_micro_batches(examples, 0, 1, 1000, pack=False)
    assert [mb.rows for mb in unpacked] == [[0], [1], [2], [3], [4]]


def test_shared_micro_batches_count_computed_tokens_within_the_budget():
    prompt = list(range(100, 160))
    examples = [Example(str(i), prompt + [i] * (10 + i), [0] * 60 + [1] * (10 + i)) for i in range(6)]
    (only,) = rank_micro_batches(examples, 0, 1, 10_000, share=True)
    assert sorted(only.rows) == list(range(6)) and only.tokens == 60 + sum(10 + i for i in range(6))
    split = rank_micro_batches(examples, 0, 1, 60 + 10 + 11 + 12, share=True)
    assert [mb.rows for mb in split] == [[0, 1, 2], [3, 4], [5]]  # token order; a full tree starts the next
    assert [mb.tokens for mb in split] == [93, 60 + 13 + 14, 75]


def test_packed_rows_give_the_same_loss_as_separate_rows(tokenizer, tiny_model_dir):
    """Restarting position_ids make transformers build a block-diagonal mask on SDPA."""
    from transformers import AutoModelForCausalLM

    model = StepPolicy(AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa"), 1.0)
    examples = [tokenize_row(tokenizer, conversation(random.Random(s)), 4096) for s in (1, 2)]
    packed = sft.token_ce_sum(model, collate(examples))
    separate = sum(sft.token_ce_sum(model, collate([e])) for e in examples)
    assert torch.allclose(packed, separate, rtol=1e-5)


def test_cosine_schedule_with_warmup():
    factor = cosine_with_warmup(total_steps=20, warmup_ratio=0.1)
    assert [factor(s) for s in (0, 1)] == [0.5, 1.0]
    assert factor(11) == pytest.approx(0.5) and 0 < factor(19) < 0.01


def test_deepspeed_configs_fill_auto_values():
    cpu = deepspeed_config(2, offload=True, grad_clip=1.0, device="cpu", mixed=None)
    assert cpu["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in cpu["zero_optimization"]
    assert cpu["gradient_clipping"] == 1.0 and cpu["bf16"]["enabled"] is False
    assert "auto" not in json.dumps(cpu)
    # on the CPU there is no communication to overlap, and buckets of 2e7 elements (80 MB in fp32),
    # not the 5e8 (2 GB) that pay between GPUs, whatever the number of processes
    for world in (1, 2):
        zero = deepspeed_config(2, offload=False, grad_clip=1.0, device="cpu", mixed=None, world=world)[
            "zero_optimization"]
        assert zero["reduce_bucket_size"] == 2e7 == zero["allgather_bucket_size"] and zero["overlap_comm"] is False
    assert deepspeed_config(3, offload=False, grad_clip=1.0, device="cpu", mixed=None)["zero_optimization"][
        "stage3_prefetch_bucket_size"] == 1e7
    gpu = deepspeed_config(3, offload=True, grad_clip=0.5, device="cuda:0", mixed="bf16")
    zero = gpu["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu" and gpu["bf16"]["enabled"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] and "auto" not in json.dumps(gpu)


def test_deepspeed_bf16_accumulates_fp32_and_one_gpu_keeps_no_spare_buffers():
    one = deepspeed_config(2, offload=False, grad_clip=1.0, device="cuda:0", mixed="bf16")
    assert one["data_types"]["grad_accum_dtype"] == "fp32"  # not DeepSpeed's default, the model's bf16
    assert one["zero_optimization"]["overlap_comm"] is False
    assert one["zero_optimization"]["reduce_bucket_size"] == 2e7 == one["zero_optimization"]["allgather_bucket_size"]
    four = deepspeed_config(2, offload=False, grad_clip=1.0, device="cuda:0", mixed="bf16", world=4)
    assert four["zero_optimization"]["overlap_comm"] is True and four["zero_optimization"]["reduce_bucket_size"] == 5e8
    fp32 = deepspeed_config(2, offload=False, grad_clip=1.0, device="cuda:0", mixed=None, world=4)
    assert "data_types" not in fp32  # fp32 gradients are fp32 already
    assert deepspeed_config(2, offload=False, grad_clip=1.0, device="cpu", mixed=None, world=2)[
        "zero_optimization"]["overlap_comm"] is False


# ---- training ----------------------------------------------------------------------------------


def test_tiny_run_learns_and_its_checkpoint_reloads_and_generates(data, tiny_model_dir, tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    result = sft.run(make_config(data, tiny_model_dir, out, epochs=3))
    seen = losses(out)
    assert len(seen) == 6 and seen[-1] < seen[0] - 0.3
    assert result["complete"] and result["val_loss"] is not None and result["data"]["kept"] == 8
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "epoch", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "trained_tokens"} <= set(rows[0])
    peaks = [r["peak_rss_gb"] for r in rows]  # the process's peak so far: it never goes down
    assert 0 < peaks[0] and peaks == sorted(peaks) and peaks[-1] <= result["peak_rss_gb"]
    assert [r["val_loss"] is not None for r in rows] == [False, True] * 3
    assert all((out / f"epoch-{k}" / "model.safetensors").is_file() for k in (1, 2, 3))
    assert json.loads((out / "manifest.json").read_text())["stage"] == "sft"
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert tok.chat_template == tokenizer.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "State:"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 5
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)


def test_resume_reproduces_the_uninterrupted_run(data, tiny_model_dir, tmp_path):
    straight = tmp_path / "straight"
    sft.run(make_config(data, tiny_model_dir, straight, epochs=2))
    out = tmp_path / "resumed"
    first = sft.run(make_config(data, tiny_model_dir, out, stop_after_steps=1))  # mid-epoch
    assert first["stopped_early"] and not (out / "final").exists()
    with pytest.raises(UserError, match="--resume"):
        sft.run(make_config(data, tiny_model_dir, out))
    sft.run(make_config(data, tiny_model_dir, out, resume=True, stop_after_steps=2))  # the epoch boundary
    assert (out / "epoch-1").is_dir() and not (out / "epoch-2").exists()
    done = sft.run(make_config(data, tiny_model_dir, out, resume=True))
    assert done["complete"] and losses(out) == losses(straight)
    for name in ("model.safetensors",):
        assert (out / "final" / name).read_bytes() == (straight / "final" / name).read_bytes()
    again = sft.run(make_config(data, tiny_model_dir, out, resume=True))
    assert again["already_complete"] and again["final"] == str(out / "final")
    with pytest.raises(UserError, match="sft.lr"):
        sft.run(make_config(data, tiny_model_dir, out, resume=True, lr=2e-3))


def test_a_crash_resumes_from_the_last_periodic_save(data, tiny_model_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    sft.run(make_config(data, tiny_model_dir, straight, epochs=1, global_batch=2))
    real_step = sft._Trainer._train_step

    def crash_at_step_4(self, rows, progress):
        if progress.global_step == 3:
            raise KeyboardInterrupt
        return real_step(self, rows, progress)

    monkeypatch.setattr(sft._Trainer, "_train_step", crash_at_step_4)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        sft.run(make_config(data, tiny_model_dir, out, epochs=1, global_batch=2, save_every_steps=2))
    assert len(losses(out)) == 3  # step 3 ran but was never saved
    state = json.loads((out / "trainer_state" / "progress.json").read_text())["progress"]
    assert (state["epoch"], state["step"], state["global_step"]) == (0, 2, 2)
    monkeypatch.setattr(sft._Trainer, "_train_step", real_step)
    sft.run(make_config(data, tiny_model_dir, out, epochs=1, global_batch=2, resume=True))
    assert losses(out) == losses(straight)


def test_deepspeed_zero2_matches_plain_torch_and_resumes_exactly(data, tiny_model_dir, tmp_path):
    torch_run = tmp_path / "torch"
    sft.run(make_config(data, tiny_model_dir, torch_run))
    straight = tmp_path / "ds"
    sft.run(make_config(data, tiny_model_dir, straight, zero_stage=2))
    assert losses(straight) == pytest.approx(losses(torch_run), rel=1e-5)
    out = tmp_path / "ds-resumed"
    sft.run(make_config(data, tiny_model_dir, out, zero_stage=2, stop_after_steps=2))
    sft.run(make_config(data, tiny_model_dir, out, zero_stage=2, resume=True))
    assert losses(out) == losses(straight)


@pytest.mark.parametrize("stage", [2, 3])
def test_shared_prefix_trains_as_unshared_rows_do_under_zero(stage, data, tiny_model_dir, tmp_path):
    """ZeRO-2 and ZeRO-3 on DeepSpeed's CPU accelerator, rows' common prefixes computed once or
    not: fewer tokens computed, the same loss at every step (each after the previous steps'
    updates, so the gradients agree too; fp32, the tolerance of the gradient test above)."""
    runs = {}
    for share in (False, True):
        out = tmp_path / f"share-{share}"
        sft.run(make_config(data, tiny_model_dir, out, zero_stage=stage, share_prefix=share))
        runs[share] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    unshared, shared = runs[False], runs[True]
    assert [m["tokens"] for m in shared] == [m["tokens"] for m in unshared]
    assert all(m["computed_tokens"] == m["tokens"] for m in unshared)
    assert all(s["computed_tokens"] < s["tokens"] for s in shared)
    assert [m["loss"] for m in shared] == pytest.approx([m["loss"] for m in unshared], rel=1e-4)


def test_gradient_checkpointing_trains_the_same_losses(data, tiny_model_dir, tmp_path):
    sft.run(make_config(data, tiny_model_dir, tmp_path / "low", epochs=1, gradient_checkpointing=True))
    sft.run(make_config(data, tiny_model_dir, tmp_path / "plain", epochs=1))
    assert len(losses(tmp_path / "low")) >= 2
    # the recomputed forward is the same float32 arithmetic: what differs is rounding order, ~1e-7
    # relative an operation, carried through a few small AdamW steps
    assert losses(tmp_path / "low") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)


def test_a_finished_run_leaves_no_model_behind(data, tiny_model_dir, tmp_path):
    before = live_modules()
    sft.run(make_config(data, tiny_model_dir, tmp_path / "run", zero_stage=2))
    assert live_modules() == before


@pytest.mark.parametrize("share", [False, True])
def test_a_finished_run_frees_its_model_without_the_cycle_collector(share, data, tiny_model_dir, tmp_path):
    """Plain torch, rows alone or node by node: nothing of the run is left in a reference cycle, which
    would hold the model, its gradients and optimizer state until Python's collector ran (in
    `spa pipeline`, into PPO)."""
    import gc

    before = live_modules()
    gc.disable()
    try:
        sft.run(make_config(data, tiny_model_dir, tmp_path / "run", share_prefix=share))
        assert live_modules(collect=False) == before
    finally:
        gc.enable()


def test_bfloat16_on_the_cpu_trains_fp32_weights_under_autocast(data, tiny_model_dir, tmp_path):
    """model.dtype=bfloat16 on the CPU computes in bf16 over fp32 weights, with plain torch and with
    DeepSpeed alike (DeepSpeed's own bf16 mode is used on CUDA only; see stages/engine.py)."""
    from safetensors.torch import load_file

    runs = {}
    for stage in (0, 2):
        out = tmp_path / f"bf16-zero{stage}"
        # Rows alone: with shared prefixes plain torch trains node by node and ZeRO in one pass,
        # which round apart in bf16; the engines are compared on the same arithmetic.
        config = make_config(data, tiny_model_dir, out, zero_stage=stage, share_prefix=False)
        config.model.dtype = "bfloat16"
        sft.run(config)
        runs[stage] = losses(out)
        weights = load_file(out / "final" / "model.safetensors")
        assert {tensor.dtype for tensor in weights.values()} == {torch.float32}
    assert runs[2] == pytest.approx(runs[0], rel=1e-5)
    fp32 = tmp_path / "fp32"
    sft.run(make_config(data, tiny_model_dir, fp32, share_prefix=False))
    # the same weights and data: only bf16 rounding tells the runs apart (fp32 runs repeat exactly)
    assert losses(fp32)[0] != runs[0][0]
    assert losses(fp32)[0] == pytest.approx(runs[0][0], rel=1e-3)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["checkpointing-off", "checkpointing-on"])
def test_bfloat16_trains_through_the_chunked_head(data, tiny_model_dir, tmp_path, monkeypatch, checkpointing):
    """`spa sft` in bf16 with the LM head chunked at 8 positions (every micro-batch spans several
    chunks, each recomputed in the backward): it trains, its losses within 1% (2.6 bf16 units) of
    fp32's; tests/test_bf16_training.py bounds the gradients."""
    from stages.training import policy

    monkeypatch.setattr(policy, "HEAD_CHUNK_BYTES", 8 * 4 * len(load_tokenizer(str(tiny_model_dir))))
    runs = {}
    for dtype in ("bfloat16", "float32"):
        config = make_config(data, tiny_model_dir, tmp_path / dtype, gradient_checkpointing=checkpointing)
        config.model.dtype = dtype
        sft.run(config)
        runs[dtype] = losses(tmp_path / dtype)
    assert runs["bfloat16"] == pytest.approx(runs["float32"], rel=1e-2)


def test_lora_run_saves_a_merged_plain_checkpoint(data, tiny_model_dir, tmp_path):
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    sft.run(make_config(data, tiny_model_dir, out, epochs=1, lora_rank=4, lora_alpha=8, lr=1e-2))
    keys = load_file(out / "final" / "model.safetensors").keys()
    assert not any("lora" in k or "base_layer" in k for k in keys)
    merged = AutoModelForCausalLM.from_pretrained(out / "final")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[q], base.state_dict()[q])
    embed = "model.embed_tokens.weight"  # not a LoRA target: untouched
    assert torch.equal(merged.state_dict()[embed], base.state_dict()[embed])


def test_dry_run_writes_the_trained_spans_and_does_not_train(data, tiny_model_dir, tmp_path):
    out = tmp_path / "dry"
    result = sft.run(make_config(data, tiny_model_dir, out), dry_run=True)
    text = Path(result["dry_run"]).read_text()
    assert text.count("[[TRAIN]]") >= 2 and "<|im_end|>[[/TRAIN]]" in text
    assert "[[TRAIN]]<think> <observation>" in text
    assert [p.name for p in out.iterdir()] == ["dry_run.txt"]
    sft.run(make_config(data, tiny_model_dir, out, epochs=1, stop_after_steps=1))  # a dry run does not block


# ---- bad input ---------------------------------------------------------------------------------


def test_rows_without_an_assistant_turn_are_an_error(tmp_path, tiny_model_dir):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError, match="row 1 has no assistant message"):
        sft.run(make_config(path, tiny_model_dir, tmp_path / "out"))


def test_an_empty_data_file_is_an_error(tmp_path, tiny_model_dir):
    path = tmp_path / "sft.jsonl"
    path.write_text("")
    with pytest.raises(UserError, match="has no rows"):
        sft.run(make_config(path, tiny_model_dir, tmp_path / "out"))


def test_a_model_directory_without_a_tokenizer_is_an_error(tmp_path, data, tiny_model_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((tiny_model_dir / name).read_bytes())
    with pytest.raises(UserError, match="tokenizer"):
        sft.run(make_config(data, bare, tmp_path / "out"))


def test_rows_too_long_for_any_loss_are_an_error(tmp_path, data, tiny_model_dir):
    with pytest.raises(UserError, match="max_length"):
        sft.run(make_config(data, tiny_model_dir, tmp_path / "out", max_length=1))


# ---- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_bf16_on_cuda_trains_and_saves(stage, data, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / f"zero{stage}"
    result = sft.run(make_config(data, tiny_model_dir, out, zero_stage=stage, epochs=3))
    seen = losses(out)
    assert result["complete"] and seen[-1] < seen[0] - 0.3
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.dtype == torch.bfloat16 and model.model.embed_tokens.weight.abs().sum() > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_bf16_accumulates_micro_batch_gradients_in_fp32(stage, device):
    """The engine's bf16 config under each ZeRO stage (DeepSpeed's own bf16, as on CUDA; on the CPU
    through its CPU accelerator): a micro-batch gradient of 1, then 29 of 2**-10. Added in bf16
    (8 significant bits) each 2**-10 is lost against 1 and the sum stays 1.0; in fp32 it is
    1 + 29/1024, which ZeRO-1 rounds once to bf16 for its reduction (at most 2**-8 relative)."""
    from deepspeed.utils import safe_get_full_grad

    from stages.training import engine as eng

    dist = eng.setup_distributed(device, use_deepspeed=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 1, bias=False).to(device=dist.device, dtype=torch.bfloat16)
    config = eng.deepspeed_config(stage, offload=False, grad_clip=0.0, device=dist.device, mixed="bf16")
    engine = eng.DeepSpeedEngine(model, eng.OptimSettings(0.0, (0.9, 0.999), 0.0, 0.0, 10, 0.0), dist, config)
    inputs = [torch.ones(1, 256)] + [torch.full((1, 256), 2.0**-10)] * 29  # d(w . x)/dw = x, exactly
    for index, x in enumerate(inputs):
        engine.backward(engine(input=x.to(dist.device, torch.bfloat16)).sum(), last=index == len(inputs) - 1)
    summed = safe_get_full_grad(engine.module.weight).float().cpu()
    exact = 1 + 29 / 1024
    assert summed.dtype == torch.float32 and float((summed - exact).abs().max()) <= 2.0**-8 * exact
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_rows_under_flash_attention_give_the_same_loss_as_separate_rows(tokenizer, tiny_model_dir):
    """What `spa sft` packs on a GPU: flash-attention 2 reads the restarting position_ids as
    sequence boundaries, so packed rows do not attend to each other."""
    pytest.importorskip("flash_attn")
    from transformers import AutoModelForCausalLM

    from stages.common.models import pick_attention

    assert pick_attention("auto", "cuda", torch.bfloat16) == "flash_attention_2"  # what sft then packs for
    model = StepPolicy(AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="flash_attention_2",
                                                            dtype=torch.bfloat16).cuda(), 1.0)
    examples = [tokenize_row(tokenizer, conversation(random.Random(s)), 4096) for s in (1, 2, 3)]
    with torch.no_grad():
        packed = sft.token_ce_sum(model, collate(examples, "cuda"))
        separate = sum(sft.token_ce_sum(model, collate([e], "cuda")) for e in examples)
    assert torch.allclose(packed, separate, rtol=1e-2)  # bf16


@pytest.mark.slow
def test_two_processes_under_torchrun_match_one_process(data, tiny_model_dir, tmp_path):
    """The multi-GPU logic (rank shares, zero-weight fillers, global token normalisation, rank-0
    saving) on two CPU processes with gloo: packed, uneven micro-batches give the single-process loss."""
    import shutil
    import subprocess
    import sys

    sets = ["sft.epochs=2", "sft.global_batch=3", "sft.lr=1e-3", "sft.warmup_ratio=0"]
    one = tmp_path / "one"
    sft.run(make_config(data, tiny_model_dir, one, global_batch=3))
    two = tmp_path / "two"
    spa = shutil.which("spa", path=str(Path(sys.executable).parent))
    from stages.common.distributed import free_port

    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, spa,
           "sft", "--data", str(data), "--model", str(tiny_model_dir), "--out", str(two), "-q",
           *[arg for s in [*sets, "sft.packing=true", "sft.micro_batch_tokens=400"] for arg in ("--set", s)]]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    assert losses(two) == pytest.approx(losses(one), rel=1e-6)
    assert (two / "final" / "model.safetensors").is_file()


# ---- one row per turn, shared ----------------------------------------------------------------------


def turn_rows(rng: random.Random, source: str, turns: int) -> list[dict]:
    """SPA's layout: one row per assistant turn, the chat up to it as context, that turn trained."""
    messages = conversation(rng, turns)
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    rows = []
    for t, end in enumerate(assistants):
        chat = [{**m, "train": i == end} if m["role"] == "assistant" else m for i, m in enumerate(messages[:end + 1])]
        rows.append({"id": f"{source}-turn{t + 1}", "source_id": source, "messages": chat})
    return rows


def test_epoch_steps_keep_a_trajectorys_rows_together():
    sources = ["a", "a", "a", "b", "c", "c"]
    steps = epoch_steps(6, epoch=0, seed=1, global_batch=6, sources=sources)
    order = steps[0]
    assert sorted(order) == list(range(6))
    for source in "abc":
        rows = [i for i, s in enumerate(sources) if s == source]
        at = [order.index(i) for i in rows]
        assert at == list(range(at[0], at[0] + len(rows)))  # contiguous, in turn order
    # distinct trajectories (one row each): exactly the plain shuffle
    assert epoch_steps(7, 3, 5, 2, sources=list("abcdefg")) == epoch_steps(7, 3, 5, 2)


def rows_under_two_system_prompts(tokenizer, tiny_model_dir, seed: int, plain_rows: int):
    """Turn rows of two trajectories, `plain_rows` whole-trajectory rows and two rows under another
    system prompt, tokenized; and the tiny model (spa's SDPA attention, as load_model sets it) with
    its `StepPolicy`."""
    from transformers import AutoModelForCausalLM

    from stages.common.kernels.attention import register_spa_sdpa

    rng = random.Random(seed)
    rows = turn_rows(rng, "s0", 3) + turn_rows(rng, "s1", 2) + [{"messages": conversation(rng, 2)}
                                                                for _ in range(plain_rows)]
    for _ in range(2):
        messages = conversation(rng, 2)
        messages[0] = {"role": "system", "content": "You are a helpful assistant. Think, then answer."}
        rows.append({"messages": messages})
    examples, _ = tokenize_rows(rows, tokenizer, max_length=2048)
    register_spa_sdpa()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    return examples, model, StepPolicy(model, temperature=1.0)


def test_shared_prefix_gives_each_rows_loss_and_every_gradient(tokenizer, tiny_model_dir):
    """Turn rows of two trajectories and whole-trajectory rows under two system prompts (the
    world-model and the base prompt's mix), in shared micro-batches: every row's summed loss and
    every parameter's gradient equal those of the rows computed one by one (fp32).

    Tolerance: both compute the same sums of the same terms, grouped differently by the kernels;
    fp32's unit roundoff 2**-24 over sums of up to ~512 terms (tokens, hidden size) bounds each
    sum's change by ~3e-5 of its terms' magnitude, over two layers: 1e-4 relative, with a floor of
    1e-4 x the largest entry for entries near 0."""

    from stages.sft import token_ce

    examples, model, policy = rows_under_two_system_prompts(tokenizer, tiny_model_dir, seed=4, plain_rows=2)

    def losses_and_grads(plan, share):
        model.zero_grad()
        per_row = torch.zeros(len(examples))
        for mb in plan:
            batch = collate([examples[i] for i in mb.rows], "cpu", share)
            per_row = per_row.index_add(0, torch.tensor(mb.rows)[batch["rows"]], token_ce(policy, batch))
        per_row.sum().backward()
        return per_row.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    shared = rank_micro_batches(examples, 0, 1, 1200, share=True)
    assert 1 < len(shared) < len(examples)
    assert sum(mb.tokens for mb in shared) < 0.8 * sum(len(e) for e in examples)  # 1830 of 2492
    alone, grads_alone = losses_and_grads(rank_micro_batches(examples, 0, 1, 1200), share=False)
    together, grads_together = losses_and_grads(shared, share=True)
    assert (alone > 0).all()
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=0)
    assert len(grads_alone) > 10 and grads_alone.keys() == grads_together.keys()
    for name, expected in grads_alone.items():
        floor = 1e-4 * expected.abs().max().item()
        torch.testing.assert_close(grads_together[name], expected, rtol=1e-4, atol=floor, msg=name)


def test_node_passes_give_the_packed_trees_losses_and_gradients_one_row_at_a_time(tokenizer, tiny_model_dir):
    """`tree_passes.backward`, what `spa sft` runs for a shared micro-batch on the CPU: over a tree
    of a shared system prompt, two trajectories' turn rows and two rows of another system prompt,
    under every `sft.loss_agg`, each parameter's gradient and the summed loss are those of the
    whole tree in one pass (fp32; the tolerance of the test above); every forward pass holds at
    most one row's tokens (its own and its ancestors'), and each token is computed
    once."""

    from stages.common import prefix_tree
    from stages.sft import token_ce
    from stages.training import tree_passes

    examples, model, policy = rows_under_two_system_prompts(tokenizer, tiny_model_dir, seed=8, plain_rows=1)
    assert tree_passes.applies("cpu", 0, False, model.config)
    held: list[int] = []

    class Engine:  # TorchEngine's calls, counting what each forward holds
        def __call__(self, **inputs):
            context = inputs["node"].context
            held.append((context[0][0].shape[2] if context else 0) + inputs["input_ids"].shape[1])
            return policy(**inputs)

        def backward(self, loss, last=True):
            loss.backward()

    for mode in loss_agg.LOSS_AGGS:
        normalizer = loss_agg.batch_normalizer(mode, sum(e.trained for e in examples), len(examples), 2048)
        model.zero_grad()
        batch = collate(examples, "cpu", share=True)
        ce = token_ce(policy, batch)
        ((ce * loss_agg.token_weights(batch["rows"], mode, normalizer)).sum() * 0.5).backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        held.clear()
        loss = tree_passes.backward(Engine(), examples, partial(loss_agg.token_weights, mode=mode,
                                                                normalizer=normalizer), 0.5)
        assert loss == pytest.approx(ce.sum().item() * 0.5, rel=1e-4)
        for name, grad in expected.items():
            torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4,
                                       atol=1e-4 * grad.abs().max().item(), msg=f"{mode}: {name}")
    packed = prefix_tree.pack([e.input_ids for e in examples])
    assert len(held) == len(packed.nodes) > len(examples)  # one pass per node
    assert max(held) == max(len(e) for e in examples)
    assert sum(end - start for start, end, _ in packed.nodes) == len(packed) < 0.8 * sum(map(len, examples))


def test_node_passes_apply_to_plain_torch_on_the_cpu_without_windows_or_checkpointing():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from stages.training import tree_passes

    llama = LlamaConfig(num_hidden_layers=2)
    assert tree_passes.applies("cpu", 0, False, llama)
    assert not tree_passes.applies("cuda", 0, False, llama)
    assert not any(tree_passes.applies("cpu", stage, False, llama) for stage in (1, 2, 3))
    assert not tree_passes.applies("cpu", 0, True, llama)
    assert tree_passes.applies("cpu", 0, False, Qwen2Config(num_hidden_layers=2))  # its window is off by default
    assert not tree_passes.applies("cpu", 0, False, Qwen2Config(num_hidden_layers=2, use_sliding_window=True,
                                                                max_window_layers=1))
    assert not tree_passes.applies("cpu", 0, False, MistralConfig(num_hidden_layers=2, sliding_window=64))


def test_a_step_has_the_gradient_of_its_loss_agg_however_rows_are_grouped(tokenizer, tiny_model_dir, tmp_path,
                                                                         monkeypatch):
    """One `spa sft` step over rows of 1 to 3 turns and a trajectory's turn rows, in shared
    micro-batches of several rows or one row each: under every `sft.loss_agg` each parameter's
    gradient at the step is that of the aggregate computed by its definition from each row alone
    (fp32; the tolerance of the test above). The modes' gradients differ by more than it, so a
    wrong weighting fails."""
    from transformers import AutoModelForCausalLM

    from stages.common.kernels.attention import register_spa_sdpa
    from stages.sft import token_ce

    rng = random.Random(6)
    rows = turn_rows(rng, "s0", 3) + [{"id": f"t{n}", "messages": conversation(rng, n)} for n in (1, 2, 3)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples, _ = tokenize_rows(rows, tokenizer, max_length=2048)
    assert len({e.trained for e in examples}) > 1  # unequal rows: the modes weigh them apart
    register_spa_sdpa()  # as load_model does
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    policy = StepPolicy(model, temperature=1.0)
    budget = make_config(data, tiny_model_dir, tmp_path).sft.max_length

    def by_definition(mode):
        model.zero_grad()
        aggregate_by_definition(mode, [token_ce(policy, collate([e])) for e in examples], budget).backward()
        return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}  # named as sft's

    def assert_close(actual, expected, msg):
        for name, grad in expected.items():
            torch.testing.assert_close(actual[name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max().item(),
                                       msg=f"{msg}: {name}")

    expected = {mode: by_definition(mode) for mode in loss_agg.LOSS_AGGS}
    for mode, other in itertools.permutations(loss_agg.LOSS_AGGS, 2):
        with pytest.raises(AssertionError):
            assert_close(expected[other], expected[mode], f"{other} for {mode}")
    captured = []
    real_step = TorchEngine.step

    def step(engine):
        captured.append({n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None})
        return real_step(engine)

    monkeypatch.setattr(TorchEngine, "step", step)
    layouts = {"shared": {"micro_batch_tokens": 400}, "each": {"share_prefix": False}}
    assert len(rank_micro_batches(examples, 0, 1, 400, share=True)) > 1
    for mode in loss_agg.LOSS_AGGS:
        for name, layout in layouts.items():
            sft.run(make_config(data, tiny_model_dir, tmp_path / f"{mode}-{name}", epochs=1,
                                global_batch=len(rows), loss_agg=mode, **layout))
            assert_close(captured.pop(), expected[mode], f"{mode}, {name}")


def test_turn_rows_train_in_fewer_computed_tokens(tmp_path, tiny_model_dir):
    rng = random.Random(5)
    rows = [row for i in range(4) for row in turn_rows(rng, f"s{i}", 3)]
    data = tmp_path / "turns.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = sft.run(make_config(data, tiny_model_dir, tmp_path / "run", epochs=1, global_batch=6))
    assert run["complete"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["trained_tokens"] for m in metrics) == sum(
        e.trained for e in tokenize_rows(rows, load_tokenizer(str(tiny_model_dir)), 2048)[0])
    assert sum(m["computed_tokens"] for m in metrics) < 0.7 * sum(m["tokens"] for m in metrics)
