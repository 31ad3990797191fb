"""Feature extraction's two engines: vLLM's features equal transformers' (`check`), and tokens/s of each (`bench`).

    .venv/bin/python benchmarks/extract_engines.py check [--engine-python .venv-vllm/bin/python] [--out DIR]
    .venv/bin/python benchmarks/extract_engines.py bench [--samples 96] [--rounds 2] [--threads 1]

`check` (`make check-vllm-extract`; the CI suite has no vLLM) runs `python -m data.extract` as users do on a tiny
random float32 Llama (2 layers, head size 64 as vLLM's CPU attention needs, the pocket tokenizer, a large init) over
48 chats, storing hidden-state indices 0, 1, 2 and -1 (embeddings, a layer's output, the last layer's output after
the final norm, twice) in float32, shards of about 1,000 tokens. It requires:
  1. `--engine vllm` writes the shards `--engine hf` writes: the same samples, token ids, loss masks and offsets, and
     per stored index hidden states within TOLERANCE of transformers' (max |difference| over max |value|); the
     manifests differ only in `engine` and in the shards' bytes;
  2. two processes (`accelerate launch --num_processes 2`, CPU, one vLLM engine each) write the same shards and
     manifest as one, byte for byte;
  3. two processes stopped after each wrote one shard (the extraction's test hook, as if killed) resume with vLLM to
     the same shards and manifest, byte for byte;
and ends with `extract_engines/check: PASS ...` (exit 0) or `extract_engines/check: FAIL: <why>` (exit 1).

`bench` loads SmolLM2-135M-Instruct in float32 both ways in this process (transformers) and in a vLLM worker, and
extracts the hidden states of `recipes/smollm2/eagle3.yaml`'s layers for the first `--samples` records of its
documentation answers (artifacts/smollm2-run/selfdistill.jsonl, as the recipe renders them) in length-sorted
batches of `data.extract_batch_tokens`, as `data.extract` does; rounds alternate transformers, vLLM, transformers,
... after a warm-up batch each. It prints the largest relative difference per layer (the SmolLM2 half of the
equivalence, same TOLERANCE), load times, tokens/s of each, and ends with
`extract/vllm_vs_hf: <ratio> (goal >= 1.0)`: vLLM's tokens/s over transformers' on `--threads` thread(s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from the repository root's environment
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TOLERANCE = 1e-4
"""Largest |vLLM - transformers| over the layer's largest |value| (float32 on both sides; different kernels)."""
GOAL = 1.0
LAYERS = [0, 1, 2, -1]


def tiny_recipe(out: Path) -> Path:
    """A tiny float32 target, 48 chats and an EAGLE-3 recipe storing LAYERS; returns the recipe's path."""
    from benchmarks.selfdistill_engines import PLAIN, tiny_target

    tiny_target(out / "target")
    chats = []
    for i in range(48):
        question = PLAIN[i % len(PLAIN)]["prompt"] * (1 + i % 4)
        answer = f"An answer of {i} words: " + " ".join(f"w{j}" for j in range(i))
        chats.append({"id": f"c{i}", "messages": [{"role": "user", "content": question},
                                                  {"role": "assistant", "content": answer}]})  # fmt: skip
    (out / "data.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    recipe = {
        "target": {"path": str(out / "target"), "dtype": "float32"},
        "data": {"train_files": [str(out / "data.jsonl")], "max_len": 256, "layers": LAYERS,
                 "features_dir": str(out / "features"), "storage_dtype": "float32", "shard_tokens": 1024},
        "drafter": {"method": "eagle3", "draft_vocab": 1024, "feature_layers": [0, 1, 2]},
        "train": {"output_dir": str(out / "train")},
    }  # fmt: skip
    path = out / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def load_dir(directory: Path) -> tuple[dict, dict[str, dict]]:
    """(manifest, {shard file: its tensors})."""
    from safetensors.torch import load_file

    manifest = json.loads((directory / "manifest.json").read_text())
    return manifest, {e["file"]: load_file(directory / e["file"]) for e in manifest["shards"]}


def relative_differences(a, b, layers: int) -> list[float]:
    """Per stored index: max |a - b| / max |a| over (tokens, layers * d) hidden states."""
    a, b = a.float().view(len(a), layers, -1), b.float().view(len(b), layers, -1)
    return [float((a[:, i] - b[:, i]).abs().max() / a[:, i].abs().max().clamp_min(1e-30)) for i in range(layers)]


def same_bytes(a: Path, b: Path) -> str | None:
    """What differs between two feature directories' manifests and shards (None: nothing)."""
    for name in sorted({p.name for p in a.glob("*.safetensors")} | {p.name for p in b.glob("*.safetensors")}):
        if not (b / name).is_file() or not (a / name).is_file() or (a / name).read_bytes() != (b / name).read_bytes():
            return name
    return None if (a / "manifest.json").read_text() == (b / "manifest.json").read_text() else "manifest.json"


def check(args: argparse.Namespace) -> str:
    from benchmarks.selfdistill_engines import free_port

    out = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    recipe = tiny_recipe(out)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    vllm = ["--engine", "vllm", "--engine-python", str(args.engine_python)]

    def extract(name: str, *extra: str, launch: list[str] = (), fails: bool = False, **more_env) -> Path:
        cmd = [*(launch or [sys.executable]), "-m", "data.extract", str(recipe), f"data.features_dir={out / name}"]
        done = subprocess.run([*cmd, *extra], cwd=ROOT, env={**env, **more_env}, capture_output=True, text=True)
        assert (done.returncode != 0) == fails, (
            f"{name}: exit {done.returncode}: {done.stderr.strip().splitlines()[-3:]}"
        )
        return out / name

    hf_dir = extract("hf")
    start = time.perf_counter()
    one = extract("vllm", *vllm)
    seconds = time.perf_counter() - start
    hf_manifest, hf = load_dir(hf_dir)
    manifest, got = load_dir(one)
    assert manifest.get("engine") == "vllm", "the manifest must record engine: vllm"
    assert len(hf) >= 4, f"the check needs several shards per process, got {len(hf)}"
    worst = [0.0] * len(LAYERS)
    for name, tensors in hf.items():
        for key in ("sample_ids", "offsets", "input_ids", "loss_mask"):
            assert (tensors[key] == got[name][key]).all(), f"{name}: {key} differ between the engines"
        worst = [max(w, d) for w, d in zip(worst, relative_differences(tensors["hidden"], got[name]["hidden"], 4))]
    assert max(worst) <= TOLERANCE, f"hidden states differ by {worst} (relative, per index {LAYERS})"
    ignore = {"engine", "shards", "total_bytes", "bytes_per_token"}
    differ = sorted(
        k for k in hf_manifest.keys() | manifest.keys() if k not in ignore and hf_manifest.get(k) != manifest.get(k)
    )
    assert not differ, f"the manifests differ in {differ}"

    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port())]
    two = extract("two", *vllm, launch=launch, ACCELERATE_USE_CPU="true")
    (two / "recipe.yaml").unlink()
    assert not (problem := same_bytes(one, two)), f"2 processes wrote another {problem} than 1"

    stop = {"SPECDRAFT_EXTRACT_STOP_AFTER_SHARDS": "1", "ACCELERATE_USE_CPU": "true"}
    extract("resumed", *vllm, launch=launch, fails=True, **stop)  # each process exits 3: the launcher 1
    part_shards = len(list((out / "resumed").glob("*.safetensors")))
    resumed = extract("resumed", *vllm, launch=launch, ACCELERATE_USE_CPU="true")
    assert not (problem := same_bytes(one, resumed)), f"the resumed run wrote another {problem}"
    return (
        f"{len(hf)} shards, {hf_manifest['num_tokens']} tokens: vLLM's token ids, loss masks and offsets equal "
        f"transformers', hidden states within {max(worst):.1e} relative (per index {LAYERS}: "
        f"{', '.join(f'{w:.1e}' for w in worst)}; 1 process, {seconds:.0f} s with its start); 2 processes wrote the "
        f"same bytes; stopped with {part_shards}/{len(hf)} shards written, resumed to the same bytes"
    )


# ------------------------------------------------------------------------------------------------------------ bench


def bench(args: argparse.Namespace) -> None:
    import torch

    from data.codecs import make_codec
    from data.extract import extract_shard
    from data.prepare import prepare_dataset
    from data.vllm_features import load_vllm_target
    from models.target import load_target
    from schema.recipe import load_recipe

    torch.set_num_threads(args.threads)
    records = Path(args.records).read_text().splitlines()[: args.samples]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").write_text("".join(line + "\n" for line in records))
    overrides = ["target.dtype=float32", f"data.train_files=[{out / 'records.jsonl'}]", "data.heldout_fraction=0"]
    recipe = load_recipe(args.recipe, overrides + [f"data.features_dir={out / 'unused'}"])
    print(f"uptime: {os.popen('uptime').read().strip()}")
    t0 = time.perf_counter()
    hf = load_target(**dataclasses.asdict(recipe.target))
    hf_load = time.perf_counter() - t0
    samples = sorted(prepare_dataset(recipe.data, hf.tokenizer).samples, key=lambda s: len(s["input_ids"]))
    tokens = sum(len(s["input_ids"]) for s in samples)
    t0 = time.perf_counter()
    state = types.SimpleNamespace(num_processes=1, local_process_index=0)
    vllm = load_vllm_target(recipe.target, hf.tokenizer, state, python=args.engine_python, engine_args={},
                            log=out / "vllm.log", longest=len(samples[-1]["input_ids"]),
                            batch_tokens=recipe.data.extract_batch_tokens)  # fmt: skip
    vllm_load = time.perf_counter() - t0
    layers = recipe.data.layers
    codec = make_codec("float32", len(layers), hf.hidden_size)
    print(f"{len(samples)} samples, {tokens} tokens, layers {layers}; load: transformers {hf_load:.1f} s, "
          f"vLLM {vllm_load:.1f} s (worker start and engine build)")  # fmt: skip
    seconds = {"hf": 0.0, "vllm": 0.0}
    hidden = {}
    try:
        for target in (hf, vllm):  # warm-up: one short batch each
            extract_shard(target, samples[:4], layers, codec, recipe.data.extract_batch_tokens)
        for _ in range(args.rounds):
            for name, target in (("hf", hf), ("vllm", vllm)):
                t0 = time.perf_counter()
                _, _, parts = extract_shard(target, samples, layers, codec, recipe.data.extract_batch_tokens)
                seconds[name] += time.perf_counter() - t0
                hidden[name] = parts["hidden"]
                print(f"  {name}: {tokens / (time.perf_counter() - t0):.0f} tokens/s")
    finally:
        vllm.close()
    worst = relative_differences(hidden["hf"], hidden["vllm"], len(layers))
    print(f"relative difference per index {layers}: {', '.join(f'{w:.1e}' for w in worst)} "
          f"({'within' if max(worst) <= TOLERANCE else 'OVER'} {TOLERANCE:.0e})")  # fmt: skip
    rates = {name: args.rounds * tokens / s for name, s in seconds.items()}
    print(f"tokens/s on {args.threads} thread(s): transformers {rates['hf']:.0f}, vLLM {rates['vllm']:.0f}")
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(f"extract/vllm_vs_hf: {rates['vllm'] / rates['hf']:.2f} (goal >= {GOAL})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="vLLM's features equal transformers'; 2 processes; resume")
    c.add_argument("--engine-python", type=Path, default=VLLM_PYTHON)
    c.add_argument("--out", type=Path, default=ROOT / "runs" / "extract-engines-check")
    b = sub.add_parser("bench", help="tokens/s of both engines on SmolLM2 (float32)")
    b.add_argument("--recipe", default="recipes/smollm2/eagle3.yaml")
    b.add_argument("--records", default="artifacts/smollm2-run/selfdistill.jsonl")
    b.add_argument("--samples", type=int, default=96)
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--engine-python", default=str(VLLM_PYTHON))
    b.add_argument("--out", default=str(ROOT / "runs" / "extract-engines-bench"))
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.command == "bench":
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        bench(args)
        return
    try:
        what = check(args)
    except AssertionError as exc:
        print(f"extract_engines/check: FAIL: {exc}")
        sys.exit(1)
    print(f"extract_engines/check: PASS: {what}")


if __name__ == "__main__":
    main()
