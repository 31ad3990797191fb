"""Feature extraction cost vs a bare target forward, and storage per token.

    .venv/bin/python -m benchmarks.extract [--batches 4] [--rounds 5] [--threads 1] [--layers -1]

Target: random-init Llama, 4 layers, d=256, vocab 8192 (float32 compute on CPU). Data: `--batches`
batches of 8 samples × 512 tokens. Each round times (a) the bare decoder forward `model.model(...)`
over the same batches (no hooks, no lm_head, nothing stored) and (b) the full extraction
(`data.extract.extract_features`: shard plan, hooked forward, bf16 cast, shard write with sha256,
manifest), interleaved after a warm-up; the best round of each is compared. Both wall-clock and
process CPU time (user + sys, all threads) are measured; the goal line uses CPU time, because on a
shared machine other jobs' load makes wall-clock rounds vary by 2-3x while the work done by this
process (forward, casts, copies, hashing, writing into the page cache) is what extraction adds. Goals: extraction
tokens/s ≥ 0.9 × forward tokens/s, and bytes per token ≤ 1.02 × 2·d·n_layers (bf16 storage).

Checksums, for information (no goal): on the features of one more extraction, each round times (c) opening them as
training does (`FeatureDataset`, which hashes every shard, the default) against opening them with
`verify_checksums=False`, and (d) one pass that only reads the data the way training reads it (`BatchLoader` over
the dataset: shuffled, packed rows of 512 tokens, batches of 8, every sample once, no training step), page cache
warm, CPU time, best round of each. Hashing page-cached bytes costs about as much as reading them, so (c) is of the
order of (d); the goal for the hashing is against what a pass over the data costs in training, an epoch of
optimizer steps: `benchmarks/train_step.py`, `train/checksum_share`.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from data.extract import extract_features
from data.loader import BatchLoader
from data.shards import FeatureDataset
from models.target import load_target

D, N_LAYERS, VOCAB, BATCH, SEQ = 256, 4, 8192, 8, 512


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.extract", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: no spin-waits on shared CPUs)")
    parser.add_argument("--layers", type=int, nargs="+", default=[-1], help="stored hidden-state indices")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_target(
        random_init={
            "model_type": "llama",
            "vocab_size": VOCAB,
            "hidden_size": D,
            "intermediate_size": 704,
            "num_hidden_layers": N_LAYERS,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        dtype="float32",
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (args.batches * BATCH, SEQ), generator=g)
    samples = [{"id": i, "input_ids": row.tolist(), "loss_mask": [1] * SEQ} for i, row in enumerate(ids)]
    batches = ids.view(args.batches, BATCH, SEQ)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    tokens = ids.numel()
    header = {"target": target.identity(), "layers": args.layers, "hidden_size": D, "dtype": "bfloat16", "template": ""}

    def bare() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            for batch in batches:
                target.base(input_ids=batch, attention_mask=mask, use_cache=False)
        return time.perf_counter() - wall, time.process_time() - cpu

    def extract() -> tuple[float, float, dict]:
        with tempfile.TemporaryDirectory() as directory:
            wall, cpu = time.perf_counter(), time.process_time()
            manifest = extract_features(
                target, samples, directory, header, shard_tokens=2 * BATCH * SEQ, batch_tokens=BATCH * SEQ
            )
            return time.perf_counter() - wall, time.process_time() - cpu, manifest

    bare()  # warm-up: allocator, sdpa kernels
    extract()
    bare_wall, bare_cpu, extract_wall, extract_cpu = [], [], [], []
    for r in range(args.rounds):
        wall, cpu = bare()
        bare_wall.append(wall)
        bare_cpu.append(cpu)
        wall, cpu, manifest = extract()
        extract_wall.append(wall)
        extract_cpu.append(cpu)
        print(
            f"round {r}: forward {tokens / bare_wall[-1]:,.0f} tok/s ({tokens / bare_cpu[-1]:,.0f} tok/cpu-s), "
            f"extract {tokens / extract_wall[-1]:,.0f} tok/s ({tokens / extract_cpu[-1]:,.0f} tok/cpu-s)",
            flush=True,
        )
    hidden_bytes = 2 * D * len(args.layers)
    print(
        f"target: llama {N_LAYERS} layers, d={D}, vocab {VOCAB}, float32 compute, {torch.get_num_threads()} threads; "
        f"{args.batches} batches of {BATCH}x{SEQ} tokens, stored layers {args.layers} in bfloat16"
    )
    print(
        f"best of {args.rounds}: forward {tokens / min(bare_wall):,.0f} tok/s, "
        f"extract {tokens / min(extract_wall):,.0f} tok/s (ratio {min(bare_wall) / min(extract_wall):.2f}); "
        f"forward {tokens / min(bare_cpu):,.0f} tok/cpu-s, extract {tokens / min(extract_cpu):,.0f} tok/cpu-s"
    )
    print(
        f"storage: {manifest['total_bytes']:,} bytes in {len(manifest['shards'])} shards "
        f"for {manifest['num_tokens']:,} tokens = "
        f"{manifest['bytes_per_token']:.2f} bytes/token (hidden payload {hidden_bytes})"
    )

    # checksums, for information: what hashing every shard at open adds, against a read-only pass over the data
    with tempfile.TemporaryDirectory() as directory:
        features = extract_features(
            target, samples, directory, header, shard_tokens=2 * BATCH * SEQ, batch_tokens=BATCH * SEQ
        )
        open_plain, open_verified, read_pass = [], [], []
        for r in range(args.rounds):
            cpu = time.process_time()
            dataset = FeatureDataset(directory, verify_checksums=False)
            open_plain.append(time.process_time() - cpu)
            cpu = time.process_time()
            FeatureDataset(directory)  # the default: every shard's sha256 checked
            open_verified.append(time.process_time() - cpu)
            cpu = time.process_time()
            for _ in BatchLoader(dataset, batch_size=BATCH, packing=True, max_len=SEQ, seed=r).epoch(0):
                pass
            read_pass.append(time.process_time() - cpu)
    hashing, one_pass = min(open_verified) - min(open_plain), min(read_pass)
    print(
        f"checksums: {features['total_bytes']:,} bytes in {len(features['shards'])} shards; best of {args.rounds}: "
        f"hashing at open {hashing * 1e3:.1f} cpu-ms ({features['total_bytes'] / hashing / 1e9:.2f} GB/s), "
        f"one read pass {one_pass * 1e3:.1f} cpu-ms ({features['total_bytes'] / one_pass / 1e9:.2f} GB/s), "
        f"hashing / read pass {hashing / one_pass:.2f} (against a training epoch: benchmarks/train_step.py)"
    )
    print(f"extract/forward: {min(bare_cpu) / min(extract_cpu):.2f} (goal >= 0.9)")
    print(f"extract/bytes_per_token: {manifest['bytes_per_token'] / hidden_bytes:.2f} (goal <= 1.02)")


if __name__ == "__main__":
    main()
