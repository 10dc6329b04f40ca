"""The built-in model's conversion from its GGUF file (`stages.common.models._convert_gguf`): the
same directory as transformers' own GGUF loader gives."""

import importlib.util
import json
from pathlib import Path

import torch

from stages.common.models import BUILTIN_MODELS, SHIPPED_CONFIGS, _convert_gguf, _unpermute_rotary


def test_unpermute_rotary_inverts_llama_cpps_permutation():
    """llama.cpp stores a head's rows (first half, second half) as pairs (h0[i], h1[i]); rows here
    are numbered by head, half and index, so every row must come back to its own place."""
    heads, half, columns = 3, 4, 5
    hf = torch.arange(heads * 2 * half, dtype=torch.float32)[:, None].expand(-1, columns).contiguous()
    stored = torch.stack([hf.reshape(heads, 2, half, columns)[:, 0], hf.reshape(heads, 2, half, columns)[:, 1]],
                         dim=2).reshape(heads * 2 * half, columns)
    assert stored[:4, 0].tolist() == [0.0, 4.0, 1.0, 5.0]  # head 0: h0[0], h1[0], h0[1], h1[1]
    assert torch.equal(_unpermute_rotary(stored, heads), hf)


def test_the_builtin_model_converts_to_what_transformers_reads_from_the_gguf(tmp_path):
    from transformers import AutoModelForCausalLM

    builtin = BUILTIN_MODELS["smollm2-135m"]
    gguf_dir = Path(importlib.util.find_spec(builtin.package).origin).parent
    _convert_gguf(gguf_dir, builtin.gguf_file, SHIPPED_CONFIGS / "smollm2-135m", tmp_path / "model")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    theirs = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=builtin.gguf_file)
    assert ours.config.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    expected = theirs.state_dict()
    assert sorted(ours.state_dict()) == sorted(expected)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    config = theirs.config.to_dict()
    config.pop("quantization_config")
    config["architectures"] = [type(theirs).__name__]  # what save_pretrained records
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert {key: config.get(key) for key in saved if key != "transformers_version"} == {
        key: value for key, value in saved.items() if key != "transformers_version"}
