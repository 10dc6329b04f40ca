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


def test_the_tensor_table_is_read_as_ggufs_own_reader_reads_it(tmp_path):
    """A file with string and nested-array metadata, an alignment of 64 and tensors of three types:
    each tensor's shape, type and bytes equal gguf's `GGUFReader`'s (which parses every value)."""
    import gguf
    import numpy as np

    from stages.common.models import _gguf_tensors

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "déf"] * 7)
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_string("general.name", "tiny")
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("a.weight", f32)
    writer.add_tensor("b.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("c.weight", np.arange(7, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = _gguf_tensors(path)
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert sorted(ours) == sorted(theirs) == ["a.weight", "b.weight", "c.weight"]
    assert {name: (shape, kind) for name, (_, kind, shape) in ours.items()} == {
        "a.weight": ((3, 5), gguf.GGMLQuantizationType.F32), "b.weight": ((2, 64), gguf.GGMLQuantizationType.Q8_0),
        "c.weight": ((7,), gguf.GGMLQuantizationType.F16)}
    for name, (data, kind, shape) in ours.items():
        assert bytes(data) == bytes(theirs[name].data.view(np.uint8)), name
    assert np.array_equal(gguf.quants.dequantize(ours["a.weight"][0], gguf.GGMLQuantizationType.F32).reshape(3, 5), f32)
