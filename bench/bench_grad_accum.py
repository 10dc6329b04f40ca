"""What summing micro-batch gradients in bf16 loses against fp32, on gradients of the bundled model.

A bf16 model under DeepSpeed (spa on CUDA) computes each micro-batch's gradients in bf16; spa's
DeepSpeed config has them summed in fp32 (``data_types.grad_accum_dtype``), which DeepSpeed does at
ZeRO-1, ZeRO-3 and, from 0.19.8, ZeRO-2 (before, ZeRO-2 added them in bf16). Here the bundled
SmolLM2-135M in bf16 takes `--micro-batches` micro-batches (30: about what PPO adds per mini-batch)
of one Sokoban SFT row each (`spa generate` with random actions, then `spa clean`, as bench_sft
makes them), each loss a sum over its trained tokens divided by the trained tokens of all of them
(spa's normalisation). The same bf16 gradients are summed three ways: in bf16, in fp32, and in fp64
(the reference). Prints one JSON object: the relative error ||sum - reference|| / ||reference||
over all parameters after 1, 2, 4, ... micro-batches for bf16 and fp32, the largest per-tensor
relative error at the end, and the rows' token counts (rows are cut to `--max-length`), on one line
(bench/run_all.py reads the last).

    python bench/bench_grad_accum.py [--micro-batches 30] [--max-length 1024]
"""

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL = "smollm2-135m"


def micro_batch_examples(count: int, max_length: int):
    from bench_sft import make_data

    from stages.common.models import load_tokenizer
    from stages.training.sft_data import read_rows, tokenize_rows

    tokenizer = load_tokenizer(MODEL)
    with tempfile.TemporaryDirectory() as work, contextlib.redirect_stdout(sys.stderr):  # stdout: the JSON only
        rows = read_rows(make_data(Path(work), count))
    examples, _ = tokenize_rows(rows, tokenizer, max_length)
    if len(examples) < count:
        raise SystemExit(f"error: {len(examples)} rows were made, {count} micro-batches asked for; lower --micro-batches")
    return examples[:count]


def relative_error(sums, references) -> float:
    num = sum(float((s.double() - r).pow(2).sum()) for s, r in zip(sums, references, strict=True))
    den = sum(float(r.pow(2).sum()) for r in references)
    return (num / den) ** 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=30)
    parser.add_argument("--max-length", type=int, default=1024)
    args = parser.parse_args()

    import torch

    from stages.common.config import ModelConfig
    from stages.common.models import load_model
    from stages.training.sft_data import collate

    examples = micro_batch_examples(args.micro_batches, args.max_length)
    model, _ = load_model(ModelConfig(name=MODEL, device="cpu", dtype="bfloat16"))
    model.config.use_cache = False
    params = [p for p in model.parameters() if p.requires_grad]
    in_bf16 = [torch.zeros_like(p) for p in params]
    in_fp32 = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    reference = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    total = sum(example.trained for example in examples)
    checkpoints = sorted({2**i for i in range(args.micro_batches.bit_length()) if 2**i <= args.micro_batches}
                         | {args.micro_batches})
    errors = {"bf16": {}, "fp32": {}}
    for index, example in enumerate(examples, start=1):
        batch = collate([example])
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       logits_to_keep=batch["keep"]).logits[0].float()
        loss = torch.nn.functional.cross_entropy(logits, batch["targets"], reduction="sum") / total
        loss.backward()
        with torch.no_grad():
            for p, b, f, r in zip(params, in_bf16, in_fp32, reference, strict=True):
                b.add_(p.grad)
                f.add_(p.grad.float())
                r.add_(p.grad.double())
        if index in checkpoints:
            errors["bf16"][index] = relative_error(in_bf16, reference)
            errors["fp32"][index] = relative_error(in_fp32, reference)
        print(f"micro-batch {index}/{args.micro_batches}", file=sys.stderr, flush=True)
    worst = {name: max(relative_error([s], [r]) for s, r in zip(sums, reference, strict=True) if r.any())
             for name, sums in (("bf16", in_bf16), ("fp32", in_fp32))}
    print(json.dumps({
        "model": MODEL, "dtype": "bfloat16", "micro_batches": args.micro_batches,
        "tokens_per_micro_batch": sorted({len(example) for example in examples}),
        "trained_tokens": total,
        "relative_error_of_the_sum": errors,
        "largest_tensor_relative_error": worst,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
