"""Self-distillation throughput: generated tokens/s at a batch size over batch 1, on the same prompts.

    python -m benchmarks.selfdistill [--target artifacts/smollm2-135m-instruct] [--prompts 16] [--batch-size 16]
        [--max-new-tokens 96] [--threads 1]

Runs `data.selfdistill`'s generator (greedy, the target in bf16) over the first N held-out SmolLM2 prompts once
one at a time and once in batches, and counts the rows whose batched output differs from their batch-1 output
(left padding changes a row's bf16 numerics, so near-ties can flip; such rows are still the target's own greedy
text, from another but equally valid rounding). Ends with `selfdistill/batch_speedup: X (goal >= 3)`.
Get the target first: `python -m models.fetch smollm2-135m-instruct`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data.generation import GenerationSettings, Generator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="artifacts/smollm2-135m-instruct")
    parser.add_argument("--prompt-file", default="recipes/smollm2/prompts/heldout.jsonl")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not (Path(args.target) / "config.json").is_file():
        raise SystemExit(f"{args.target}: no target; run `python -m models.fetch smollm2-135m-instruct` first")
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16).eval()
    settings = GenerationSettings("bench", args.max_new_tokens, 0.0, 1.0, 0, "bfloat16", args.batch_size)
    generate = Generator(model, tokenizer, settings)
    records = [json.loads(line) for line in open(args.prompt_file, encoding="utf-8")][: args.prompts]
    inputs = [
        tokenizer.apply_chat_template(r["messages"], tokenize=True, add_generation_prompt=True, return_dict=False)
        for r in records
    ]
    inputs = [list(x["input_ids"]) if isinstance(x, dict) else list(x) for x in inputs]
    generate(inputs[:1], [0])  # warm-up

    def timed(batch: int) -> tuple[float, list[list[int]]]:
        start, outs = time.perf_counter(), []
        for k in range(0, len(inputs), batch):
            chunk = inputs[k : k + batch]
            outs += [ids for _, _, ids in generate(chunk, [0] * len(chunk))]
        return time.perf_counter() - start, outs

    t1, one = timed(1)
    tb, many = timed(args.batch_size)
    tokens = sum(map(len, one))
    rate1, rate_b = tokens / t1, sum(map(len, many)) / tb
    differ = sum(a != b for a, b in zip(one, many))
    print(f"{len(inputs)} prompts, {tokens} generated tokens at batch 1 ({args.threads} thread(s), bf16)")
    print(f"batch 1: {rate1:.1f} tok/s ({t1:.1f} s); batch {args.batch_size}: {rate_b:.1f} tok/s ({tb:.1f} s)")
    print(f"rows whose batched greedy output differs from batch 1: {differ} of {len(inputs)}")
    print(f"selfdistill/batch_speedup: {rate_b / rate1:.2f} (goal >= 3)")


if __name__ == "__main__":
    main()
