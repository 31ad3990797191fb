"""Self-distillation's two engines: vLLM's records equal HF's (`check`), and vLLM's answers/s over HF's (`bench`).

    .venv/bin/python benchmarks/selfdistill_engines.py check [--engine-python .venv-vllm/bin/python] [--out DIR]
    .venv/bin/python benchmarks/selfdistill_engines.py bench [--prompts 64] [--max-new-tokens 160] [--rounds 2] \\
        [--batch-size 32] [--processes 2] [--threads 1] [--dtype bfloat16] [--vllm-args JSON]

`check` (`make check-vllm-selfdistill`; the CI suite has no vLLM) runs `python -m data.selfdistill` as users do on a
tiny random float32 Llama (2 layers, head size 64 as vLLM's CPU attention needs, the pocket tokenizer and its chat
template, a large init so that greedy choices are far from ties) over 12 prompt records: 6 plain, 6 chats (OpenAI
and ShareGPT, two of them with two assistant turns to write). Tokens the target writes (found by a first HF run) are
made EOS tokens of its generation config, so that records end both ways ("stop" and "length"). It then requires:
  1. `--engine vllm` writes the records `--engine hf` writes: the same token ids, texts, finish reasons and seeds
     (records differ only in `generation.engine`);
  2. two processes (`accelerate launch --num_processes 2`, CPU, one vLLM engine each) write the same file;
  3. sampled records (temperature 0.9, top-p 0.9; vLLM's per-request seeds) are the same whether vLLM generates all of
     them in one call or one batch at a time (`--engine-window 2`), and are not the greedy ones;
  4. a run killed (SIGKILL) after its first window is in its part file leaves no vLLM worker behind, and the resumed
     run's file equals the uninterrupted one;
and ends with `selfdistill_engines/check: PASS ...` (exit 0) or `selfdistill_engines/check: FAIL: <why>` (exit 1).

`bench` measures answers (records) per second of each engine on the same prompts: the first `--prompts` records of
recipes/smollm2/prompts/train.jsonl, SmolLM2-135M-Instruct in `--dtype` (bfloat16 by default: the dtype the SmolLM2
pipeline self-distils in), greedy, `--max-new-tokens` new tokens. Each engine runs as the pipeline runs
self-distillation: `--processes` processes of `--threads` thread(s) each (OMP_NUM_THREADS), batches of `--batch-size`
dealt round-robin; the HF engine calls `generate` once per batch (left-padded), the vLLM engine hands each process's
batches to its own engine in one `LLM.generate` call (one window) and vLLM schedules them (continuous batching). Each
round starts fresh processes for one engine (no prefix cache carried over), lets them load and warm up (a 4-token
generation), then starts every process's generation at once; the round's time is the slowest process's, from that
start to its last record (`data.selfdistill.distill_batch`, the records the CLI writes). Rounds alternate HF, vLLM, HF,
vLLM, ..., so that a change of the machine's load falls on both; the ratio is of the summed answers over the summed
seconds. It prints `uptime` before and after, load times, tokens/s, how many records the engines wrote alike (bf16
near-ties can flip a greedy token), and ends with `selfdistill/vllm_vs_hf: <ratio> (goal >= 2.0)`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from the repository root's environment
GOAL = 2.0
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


# ------------------------------------------------------------------------------------------------------------ check

PLAIN = [
    {"id": f"p{i}", "prompt": text}
    for i, text in enumerate(
        [
            "def function_0(x):\n    return x + 0\n",
            "import os\n",
            "The quick brown fox",
            "# A list of primes\nprimes = [2, 3, 5,",
            "Once upon a time,",
            "SELECT name FROM users WHERE",
        ]
    )
]
CHAT = [
    {
        "id": "openai-two-turns",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "old answer"},
            {"role": "user", "content": "And then?"},
        ],
    },
    {"id": "sharegpt", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
    {"id": "prompt-only", "messages": [{"role": "user", "content": "Write a haiku."}]},
    {
        "id": "prompts-only-two-turns",
        "messages": [{"role": "user", "content": "Name a colour."}, {"role": "user", "content": "Another one?"}],
    },
    {
        "id": "sharegpt-system",
        "conversations": [{"from": "system", "value": "Terse."}, {"from": "human", "value": "Why?"}],
    },
    {"id": "code", "messages": [{"role": "user", "content": "Fix this: `print 'x'`"}]},
]
CHECK_TOKENS = 16
CHECK_BATCH = 2


def tiny_target(path: Path) -> None:
    """A 2-layer random float32 Llama (vocab 8192, head size 64) with the pocket tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(ROOT / "recipes" / "pocket" / "target")
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(path)
    tok.save_pretrained(path)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().split(b"\n") if line.strip()]


def without_engine(records: list[dict]) -> list[dict]:
    return [r | {"generation": {k: v for k, v in r["generation"].items() if k != "engine"}} for r in records]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def check(args: argparse.Namespace) -> str:
    """Runs the check; returns what passed (raises AssertionError with what failed)."""
    from collections import Counter

    from transformers import AutoTokenizer, GenerationConfig

    out = args.out
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    target, prompts = out / "target", out / "prompts.jsonl"
    tiny_target(target)
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PLAIN + CHAT))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    vllm = ["--engine", "vllm", "--engine-python", str(args.engine_python)]

    def distill(name: str, *extra: str, launch: list[str] = (), **popen) -> subprocess.Popen | Path:
        cmd = [*(launch or [sys.executable]), "-m", "data.selfdistill", "--target", str(target)]
        cmd += ["--prompts", str(prompts), "--out", str(out / name), "--max-new-tokens", str(CHECK_TOKENS)]
        cmd += ["--batch-size", str(CHECK_BATCH), *extra]
        if popen:
            return subprocess.Popen(cmd, cwd=ROOT, env=env, **popen)
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd[-12:])} failed: {done.stderr.strip().splitlines()[-1:]}"
        return out / name

    # EOS tokens the target writes (not first), so that some records stop and others run to the limit.
    probe = read_records(distill("probe.jsonl"))
    turns = [set(ids[2:]) for r in probe for ids in [r.get("completion_ids"), *r.get("assistant_ids", [])] if ids]
    stops = [AutoTokenizer.from_pretrained(target).eos_token_id]
    while sum(1 for t in turns if t & set(stops)) < len(turns) // 2:  # tokens that end about half the turns
        stops.append(Counter(t for ids in turns if not ids & set(stops) for t in ids).most_common(1)[0][0])
    GenerationConfig(eos_token_id=stops).save_pretrained(target)

    hf = read_records(distill("hf.jsonl"))
    reasons = Counter(reason for r in hf for reason in r["generation"]["finish_reason"])
    assert reasons["stop"] and reasons["length"], f"the check needs records of both finish reasons, got {reasons}"
    turns = [len(r["assistant_ids"]) for r in hf if "assistant_ids" in r]
    assert turns.count(2) >= 2, f"the check needs chats with two assistant turns, got {turns}"
    start = time.perf_counter()
    one = read_records(distill("vllm.jsonl", *vllm))
    seconds = time.perf_counter() - start
    assert all(r["generation"].get("engine") == "vllm" for r in one), "vLLM records must say engine 'vllm'"
    differ = [a["id"] for a, b in zip(without_engine(one), hf) if a != b]
    assert len(one) == len(hf) and not differ, f"vLLM's records differ from HF's: {differ or (len(one), len(hf))}"

    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port())]
    env["ACCELERATE_USE_CPU"] = "true"
    two = distill("two.jsonl", *vllm, launch=launch)
    del env["ACCELERATE_USE_CPU"]
    assert two.read_text() == (out / "vllm.jsonl").read_text(), "2 processes wrote other records than 1"

    # Sampled records draw from vLLM's per-request generators: the same in one window as in windows of one batch.
    sampling = ["--temperature", "0.9", "--top-p", "0.9", "--seed", "3"]
    sampled = distill("sampled.jsonl", *vllm, *sampling)
    windows = distill("sampled-windows.jsonl", *vllm, *sampling, "--engine-window", str(CHECK_BATCH))
    assert sampled.read_text() == windows.read_text(), "sampled records depend on what else vLLM generated"
    moved = sum(a["completion_ids"] != b["completion_ids"] for a, b in zip(read_records(sampled), one) if "prompt" in b)
    assert moved, "sampled records equal greedy ones"

    # Killed after its first window (one batch) reached the part file; resumed.
    killed = out / "killed.jsonl"
    part = killed.with_name(killed.name + ".part0")
    with open(out / "killed.stderr", "w") as log:
        proc = distill(killed.name, *vllm, "--engine-window", str(CHECK_BATCH), stdout=log, stderr=log)
    workers: list[int] = []
    while proc.poll() is None:
        workers = children(proc.pid) or workers
        if part.exists() and part.read_bytes().count(b"\n") >= 1:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it could be killed ({proc.returncode})"
    written = part.read_bytes().count(b"\n")
    assert 0 < written < len(hf), f"the killed run's part file holds {written} of {len(hf)} records"
    deadline = time.time() + 30
    while any(alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert workers and not any(alive(pid) for pid in workers), f"vLLM worker(s) {workers} outlived the killed run"
    distill(killed.name, *vllm, "--engine-window", str(CHECK_BATCH))
    assert killed.read_text() == (out / "vllm.jsonl").read_text(), "the resumed run's records differ"
    return (
        f"{len(hf)} records ({sum(turns)} chat turns, {reasons['stop']} stopped, {reasons['length']} at the limit): "
        f"vLLM's token ids equal HF's (1 process, {seconds:.0f} s with its start; 2 processes); sampled records "
        f"({moved}/{len(PLAIN)} plain ones off greedy) the same in windows of 1 batch; killed with "
        f"{written}/{len(hf)} records written, its worker gone, resumed to the same file"
    )


# ------------------------------------------------------------------------------------------------------------ bench


def bench_prompts(args: argparse.Namespace) -> list[tuple[str, dict]]:
    lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()][: args.prompts]
    return [(str(r["id"]), r) for r in records]


def bench_worker(args: argparse.Namespace) -> None:
    """One process of one engine: load, warm up, say ready, wait for `go`, time its batches, say how long."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data import generation, selfdistill
    from data.engines import VllmEngine

    started = time.perf_counter()
    every = bench_prompts(args)
    batches = [every[k : k + args.batch_size] for k in range(0, len(every), args.batch_size)]
    mine = [b for k, b in enumerate(batches) if k % args.processes == args.rank]
    tokenizer = AutoTokenizer.from_pretrained(args.target)

    def settings(n: int) -> generation.GenerationSettings:
        return generation.GenerationSettings("bench", n, 0.0, 1.0, 0, args.dtype, args.batch_size, args.engine)

    if args.engine == "hf":
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).eval()
        generation.Generator(model, tokenizer, settings(4))([tokenizer("Hi")["input_ids"]], [0])  # warm-up
        generate = generation.Generator(model, tokenizer, settings(args.max_new_tokens))
        windows = [[b] for b in mine]
    else:
        log = Path(args.log_dir) / f"vllm{args.rank}.log"
        engine = VllmEngine(args.engine_python, args.target, args.dtype, log, engine_args=json.loads(args.vllm_args))
        stop_ids = generation.stop_token_ids(generation.target_eos(args.target), tokenizer)
        generation.VllmGenerator(engine, tokenizer, settings(4), stop_ids)([tokenizer("Hi")["input_ids"]], [0])
        generate = generation.VllmGenerator(engine, tokenizer, settings(args.max_new_tokens), stop_ids)
        windows = [mine]  # every batch of this process in one LLM.generate: vLLM batches them itself
    print(json.dumps({"ready": time.perf_counter() - started}), flush=True)
    sys.stdin.readline()  # go
    start = time.perf_counter()
    records = [out for window in windows for out in selfdistill.distill_batch([x for b in window for x in b], generate)]
    seconds = time.perf_counter() - start
    ids = {str(r["id"]): r.get("completion_ids") or r.get("assistant_ids") for r in records}
    print(json.dumps({"seconds": seconds, "records": len(records), "ids": ids}), flush=True)
    if args.engine == "vllm":
        engine.close()


def bench_round(args: argparse.Namespace, engine: str) -> dict:
    """One engine's processes: all loaded, then all started at once; the slowest one's time."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, __file__, "bench-worker", "--engine", engine, *sys.argv[2:]]
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        for r in range(args.processes)
    ]
    try:
        ready = [json.loads(p.stdout.readline() or "null") for p in procs]
        if not all(ready):
            raise SystemExit(f"bench: a {engine} worker failed to start (see its error above)")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        done = [json.loads(p.stdout.readline() or "null") for p in procs]
        if not all(done):
            raise SystemExit(f"bench: a {engine} worker failed (see its error above)")
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()
    ids = {k: v for d in done for k, v in d["ids"].items()}
    tokens = sum(len(x) if x and isinstance(x[0], int) else sum(map(len, x)) for x in ids.values())
    return {
        "load": max(r["ready"] for r in ready),
        "seconds": max(d["seconds"] for d in done),
        "records": sum(d["records"] for d in done),
        "tokens": tokens,
        "ids": ids,
    }


def flat(ids: list) -> list[int]:
    """A record's generated ids, its turns one after another."""
    return [t for turn in ids for t in turn] if ids and isinstance(ids[0], list) else list(ids)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Where two token sequences part (None when equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def bench(args: argparse.Namespace) -> None:
    if not (Path(args.target) / "config.json").is_file():
        raise SystemExit(f"{args.target}: no target; run `python -m models.fetch smollm2-135m-instruct` first")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    print(f"before: {uptime()}", flush=True)
    print(
        f"{args.prompts} prompts of {args.prompt_file}, {args.target} in {args.dtype}, greedy, up to "
        f"{args.max_new_tokens} new tokens; each engine {args.processes} process(es) x {args.threads} thread(s), "
        f"batches of {args.batch_size} (HF: one generate per batch; vLLM: one LLM.generate per process)",
        flush=True,
    )
    totals = collections.defaultdict(lambda: [0, 0.0, 0])  # engine -> records, seconds, tokens
    last = {}
    for r in range(args.rounds):
        for engine in ("hf", "vllm"):
            res = bench_round(args, engine)
            last[engine] = res["ids"]
            t = totals[engine]
            t[0], t[1], t[2] = t[0] + res["records"], t[1] + res["seconds"], t[2] + res["tokens"]
            print(
                f"round {r + 1} {engine:>4}: {res['records']} answers in {res['seconds']:.1f} s = "
                f"{res['records'] / res['seconds']:.2f} answers/s, {res['tokens'] / res['seconds']:.1f} tok/s "
                f"(load + warm-up {res['load']:.0f} s)",
                flush=True,
            )
    rates = {e: t[0] / t[1] for e, t in totals.items()}
    same = sum(last["hf"][k] == last["vllm"].get(k) for k in last["hf"])
    parted = (first_difference(flat(last["hf"][k]), flat(last["vllm"].get(k) or [])) for k in last["hf"])
    firsts = sorted(f for f in parted if f is not None)
    print(f"after: {uptime()}")
    print(f"hf {rates['hf']:.2f} answers/s, vllm {rates['vllm']:.2f} answers/s over {args.rounds} round(s) each")
    print(f"records the two engines wrote alike (token ids): {same}/{len(last['hf'])}", end="")
    print(
        f"; the others part at token {firsts[0]} to {firsts[-1]}, median {firsts[len(firsts) // 2]}" if firsts else ""
    )
    print(f"selfdistill/vllm_vs_hf: {rates['vllm'] / rates['hf']:.2f} (goal >= {GOAL})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="vLLM's records equal HF's; resume after a kill")
    c.add_argument("--engine-python", type=Path, default=VLLM_PYTHON)
    c.add_argument("--out", type=Path, default=ROOT / "runs" / "selfdistill-engines-check")
    for name in ("bench", "bench-worker"):
        b = sub.add_parser(name, help="answers/s of both engines" if name == "bench" else argparse.SUPPRESS)
        b.add_argument("--target", default="artifacts/smollm2-135m-instruct")
        b.add_argument("--prompt-file", default="recipes/smollm2/prompts/train.jsonl")
        b.add_argument("--prompts", type=int, default=64)
        b.add_argument("--max-new-tokens", type=int, default=160)
        b.add_argument("--batch-size", type=int, default=32)
        b.add_argument("--processes", type=int, default=2)
        b.add_argument("--threads", type=int, default=1)
        b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
        b.add_argument("--rounds", type=int, default=2, help="HF, vLLM, HF, vLLM, ...")
        b.add_argument("--engine-python", default=str(VLLM_PYTHON))
        b.add_argument("--vllm-args", default="{}", help="JSON of vllm.LLM arguments")
        b.add_argument("--log-dir", default=str(ROOT / "runs" / "selfdistill-engines-bench"))
        if name == "bench-worker":
            b.add_argument("--engine", choices=["hf", "vllm"], required=True)
            b.add_argument("--rank", type=int, required=True)
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.command == "bench":
        bench(args)
    elif args.command == "bench-worker":
        bench_worker(args)
    else:
        try:
            what = check(args)
        except AssertionError as exc:
            print(f"selfdistill_engines/check: FAIL: {exc}")
            sys.exit(1)
        print(f"selfdistill_engines/check: PASS: {what}")


if __name__ == "__main__":
    main()
