"""Feature extraction cost vs a bare target forward, and storage per token.

    .venv/bin/python -m benchmarks.extract [--batches 6] [--rounds 5] [--layers -1]

Target: random-init Llama, 4 layers, d=256, vocab 8192 (float32 compute on CPU). Data: `--batches`
batches of 8 samples × 512 tokens. Each round times (a) the bare decoder forward `model.model(...)`
over the same batches (no hooks, no lm_head, nothing stored) and (b) the full extraction
(`data.extract.extract_features`: shard plan, hooked forward, bf16 cast, shard write with sha256,
manifest), interleaved after a warm-up; the best round of each is compared (the CPUs are shared, so
the minimum is the least noisy estimate; the median of the per-round ratios is printed too). Goals: extraction
tokens/s ≥ 0.9 × forward tokens/s, and bytes per token ≤ 1.02 × 2·d·n_layers (bf16 storage).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from data.extract import extract_features
from models.target import load_target

D, N_LAYERS, VOCAB, BATCH, SEQ = 256, 4, 8192, 8, 512


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.extract", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, nargs="+", default=[-1], help="stored hidden-state indices")
    args = parser.parse_args()

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

    def bare() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                target.base(input_ids=batch, attention_mask=mask, use_cache=False)
        return time.perf_counter() - t0

    def extract() -> tuple[float, dict]:
        with tempfile.TemporaryDirectory() as directory:
            t0 = time.perf_counter()
            manifest = extract_features(
                target, samples, directory, header, shard_tokens=2 * BATCH * SEQ, batch_tokens=BATCH * SEQ
            )
            return time.perf_counter() - t0, manifest

    bare()  # warm-up: allocator, sdpa kernels
    extract()
    bare_times, extract_times = [], []
    for r in range(args.rounds):
        bare_times.append(bare())
        seconds, manifest = extract()
        extract_times.append(seconds)
        print(
            f"round {r}: forward {tokens / bare_times[-1]:,.0f} tok/s, extract {tokens / seconds:,.0f} tok/s",
            flush=True,
        )
    forward_tps, extract_tps = tokens / min(bare_times), tokens / min(extract_times)
    hidden_bytes = 2 * D * len(args.layers)
    print(
        f"target: llama {N_LAYERS} layers, d={D}, vocab {VOCAB}, float32 compute, {torch.get_num_threads()} threads; "
        f"{args.batches} batches of {BATCH}x{SEQ} tokens, stored layers {args.layers} in bfloat16"
    )
    ratios = sorted(b / e for b, e in zip(bare_times, extract_times))
    print(
        f"forward (best of {args.rounds}): {forward_tps:,.0f} tok/s; extract (best): {extract_tps:,.0f} tok/s; "
        f"median per-round ratio {ratios[len(ratios) // 2]:.2f}"
    )
    print(
        f"storage: {manifest['total_bytes']:,} bytes in {len(manifest['shards'])} shards "
        f"for {manifest['num_tokens']:,} tokens = "
        f"{manifest['bytes_per_token']:.2f} bytes/token (hidden payload {hidden_bytes})"
    )
    print(f"extract/forward: {extract_tps / forward_tps:.2f} (goal >= 0.9)")
    print(f"extract/bytes_per_token: {manifest['bytes_per_token'] / hidden_bytes:.2f} (goal <= 1.02)")


if __name__ == "__main__":
    main()
