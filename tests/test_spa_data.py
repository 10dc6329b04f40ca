"""SPA's released SFT data (wm_train.parquet / wm_val.parquet, reference notes §3) through `spa sft`
and `spa clean`: files written here in SPA's schema, read back as our rows, trained on the responses."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages import clean, sft
from stages.common import spa_data
from stages.common.config import load_config
from stages.common.errors import UserError
from stages.training.sft_data import read_rows, tokenize_rows

SYSTEM = {"role": "system", "content": "You're a helpful assistant. "}
USER_1 = {"role": "user", "content": "Sokoban.\nTurn 1:\nState:\n#####\n#P_O#\n#####\n"}
ANSWER_1 = ("<think> <observation>#####\n#P_O#\n#####</observation> right <prediction>#####\n#_PO#\n#####"
            "</prediction></think><answer>Right</answer>")
USER_2 = {"role": "user", "content": "Reward:\n-0.1\n\nTurn 2:\nState:\n#####\n#_PO#\n#####\n"}
ANSWER_2 = ("<think> <observation>#####\n#_PO#\n#####</observation> again <prediction>#####\n#__S#\n#####"
            "</prediction></think><answer>Right</answer>")
OTHER_USER = {"role": "user", "content": "Sokoban.\nTurn 1:\nState:\n#####\n#O_P#\n#####\n"}
MALFORMED = "<think> I will go left </think>"  # no answer: SPA's tag check drops it

# Rows as SPA's generate_sft_data.py writes them: the messages before the turn, then the turn.
TRAIN = [
    {"prompt": [SYSTEM, USER_1], "response": ANSWER_1},
    {"prompt": [SYSTEM, USER_1, {"role": "assistant", "content": ANSWER_1}, USER_2], "response": ANSWER_2},
    {"prompt": [SYSTEM, OTHER_USER], "response": MALFORMED},
]
VAL = [{"prompt": [SYSTEM, OTHER_USER], "response": ANSWER_1}]


def write_spa_parquet(path, rows, columns=("data_source", "prompt", "response", "ability")):
    """A parquet file in SPA's schema (prompt: a list of {role, content} structs; constant extras)."""
    data = {"data_source": ["sokoban"] * len(rows), "prompt": [r["prompt"] for r in rows],
            "response": [r["response"] for r in rows], "ability": ["bfs"] * len(rows)}
    pq.write_table(pa.table({name: data[name] for name in columns}), path)
    return path


@pytest.fixture
def spa_files(tmp_path):
    return (write_spa_parquet(tmp_path / "wm_train.parquet", TRAIN),
            write_spa_parquet(tmp_path / "wm_val.parquet", VAL))


def test_rows_are_read_as_ours_with_the_response_the_trained_turn(spa_files):
    train, val = spa_files
    rows = read_rows(train)
    assert [row["id"] for row in rows] == ["wm_train-0", "wm_train-1", "wm_train-2"]
    assert rows[0]["messages"] == [SYSTEM, USER_1, {"role": "assistant", "content": ANSWER_1, "train": True}]
    assert rows[1]["messages"] == [SYSTEM, USER_1, {"role": "assistant", "content": ANSWER_1, "train": False},
                                   USER_2, {"role": "assistant", "content": ANSWER_2, "train": True}]
    # one puzzle, one source (its first user message): rows 0 and 1 together, row 2 apart
    assert rows[0]["source_id"] == rows[1]["source_id"] != rows[2]["source_id"]
    assert spa_data.locate(str(train)) == (train, val)  # wm_train -> wm_val beside it


def test_trained_spans_are_exactly_the_responses(spa_files, tokenizer):
    rows = read_rows(spa_files[0])
    examples, stats = tokenize_rows(rows, tokenizer, max_length=4096)
    assert stats.kept == 3
    for example, row in zip(examples, TRAIN):
        runs, current = [], []
        for token, trained in zip(example.input_ids, example.mask):
            if trained:
                current.append(token)
            elif current:
                runs, current = [*runs, tokenizer.decode(current)], []
        runs += [tokenizer.decode(current)] if current else []
        assert runs == [row["response"] + "<|im_end|>"]


def test_spa_sft_trains_on_them_with_their_validation_file(spa_files, tiny_model_dir, tmp_path, tokenizer):
    train, val = spa_files
    out = tmp_path / "run"
    config = load_config(None, [], {"model.name": str(tiny_model_dir), "quiet": True, "sft.data": str(train),
                                    "sft.out": str(out), "sft.zero_stage": 0, "sft.epochs": 1,
                                    "sft.global_batch": 3})
    result = sft.run(config)
    assert result["complete"] and (out / "final" / "model.safetensors").is_file()
    [row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    examples, _ = tokenize_rows(read_rows(train), tokenizer, max_length=2048)
    assert row["val_loss"] is not None and row["trained_tokens"] == sum(e.trained for e in examples)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"]["val_data"]["path"] == str(val)


def test_spa_clean_filters_dedups_and_splits_them_by_puzzle(spa_files, tmp_path):
    train, _ = spa_files
    config = load_config(None, [f"clean.data={train}", f"clean.out={tmp_path / 'sft.jsonl'}",
                                "clean.val_fraction=0.5", "quiet=true"])
    summary = clean.run(config)
    # 4 rows (train and val files); the malformed one dropped; 2 puzzles, one of them held out
    assert summary["unit"] == "turn" and summary["rows"] == 3 and summary["dropped_rows"]["format"] == 1
    rows = {r["id"]: r for name in ("sft.jsonl", "sft.val.jsonl")
            for r in map(json.loads, (tmp_path / name).read_text().splitlines())}
    assert sorted(rows) == ["wm_train-0", "wm_train-1", "wm_val-0"]
    assert rows["wm_train-1"]["messages"][-1] == {"role": "assistant", "content": ANSWER_2, "train": True}
    inputs = json.loads((tmp_path / "sft.jsonl.manifest.json").read_text())["inputs"]
    assert (inputs["data"]["path"], inputs["val_data"]["path"]) == (str(train), str(train.with_name("wm_val.parquet")))
    with pytest.raises(UserError, match="clean.random_coordinates needs trajectories from `spa generate`"):
        clean.run(load_config(None, [f"clean.data={train}", f"clean.out={tmp_path / 'x.jsonl'}",
                                     "clean.random_coordinates=true"]))


def test_a_parquet_without_prompt_or_response_is_one_line(tmp_path):
    path = write_spa_parquet(tmp_path / "wm_train.parquet", TRAIN, columns=("data_source", "prompt"))
    with pytest.raises(UserError) as err:
        read_rows(path)
    assert str(err.value) == (f"{path} is not SPA's SFT data: it has no response column (columns: data_source, "
                              "prompt); SPA's wm_train.parquet has prompt (the messages before the turn) and "
                              "response (the assistant message)")
    bad = tmp_path / "not.parquet"
    bad.write_text("prompt,response\n")
    with pytest.raises(UserError, match=r"cannot read .*not.parquet as parquet"):
        read_rows(bad)


def test_a_hub_dataset_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert spa_data.is_hub_dataset("tyzhu/SPA-sokoban-data") and not spa_data.is_hub_dataset("runs/sft.jsonl")
    with pytest.raises(UserError) as err:
        spa_data.locate("spa-test/no-such-dataset")
    assert str(err.value).startswith("cannot get the dataset 'spa-test/no-such-dataset' from the Hugging Face hub")
    assert "download its wm_train.parquet and pass the file's path" in str(err.value)
    assert "\n" not in str(err.value)


def test_spa_recipe_keeps_the_release_and_its_split_as_they_are(spa_files, tmp_path):
    train, _ = spa_files
    config = load_config(None, [f"clean.data={train}", f"clean.out={tmp_path / 'sft.jsonl'}", "clean.recipe=spa",
                                "quiet=true"])
    summary = clean.run(config)
    assert (summary["train_rows"], summary["val_rows"]) == (3, 1)
    assert summary["dropped_rows"] == {"format": 0, "duplicate": 0}
    train_rows = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    val_rows = [json.loads(line) for line in (tmp_path / "sft.val.jsonl").read_text().splitlines()]
    assert [r["id"] for r in train_rows] == ["wm_train-0", "wm_train-1", "wm_train-2"]
    assert [r["id"] for r in val_rows] == ["wm_val-0"]
    assert train_rows[2]["messages"][-1] == {"role": "assistant", "content": MALFORMED, "train": True}
