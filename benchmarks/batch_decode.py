"""Throughput of batched speculative decoding: tokens/s decoding B prompts at a time ÷ tokens/s one at a time.

    .venv/bin/python benchmarks/batch_decode.py [--target recipes/pocket/target] [--batch 4] [--prompts 8]

Decodes the same prompts (different lengths, so the KV cache is ragged) greedily with an EAGLE-2 drafter (dynamic
tree) and Medusa heads (calibrated-shape tree), random weights, and with scripted drafters that are right 60% of
the time (rows accept different lengths every round and finish in different rounds), on the pocket target (or a
random model of its shape), at batch size 1 and at batch size B (medians of interleaved repeats); checks that every
prompt gets the same tokens both ways, and ends with `eval/batch_throughput: X (goal >= 1.5)`, the ratio pooled
over the three drafters. The plain baseline gets the same treatment (`plain_generate_batch` against
`plain_generate`) for reference. The untrained drafters accept almost nothing and run slower than plain
decoding: this measures what batching buys the loop, not τ.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.eval_overhead import pocket_benchmark, random_proposers  # noqa: E402
from eval.baselines import plain_generate, plain_generate_batch  # noqa: E402
from eval.checks import PerRow, ScriptedProposer  # noqa: E402
from eval.decode import DecodeSettings, speculative_generate, speculative_generate_batch  # noqa: E402
from eval.target_runner import clock  # noqa: E402

GOAL = 1.5


def timed_runs(one, batch, prompts: list[torch.Tensor], size: int, device: str, repeats: int) -> tuple:
    """(tokens/s one prompt at a time, tokens/s in batches of `size`, same tokens both ways): medians of `repeats`
    interleaved runs (batch 1, then batched, then again), after a warm-up of both."""
    for _ in range(2):  # warm-up: the first decodes of a fresh process run several times slower
        one(prompts[0])
        batch(prompts[:size])
    single_rates, batch_rates, same = [], [], True
    for _ in range(repeats):
        start = clock(device)
        singles = [one(p) for p in prompts]
        single_rates.append(sum(len(r.tokens) for r in singles) / (clock(device) - start))
        start = clock(device)
        batched = [r for i in range(0, len(prompts), size) for r in batch(prompts[i : i + size])]
        batch_rates.append(sum(len(r.tokens) for r in batched) / (clock(device) - start))
        same &= [r.tokens for r in singles] == [r.tokens for r in batched]
    return statistics.median(single_rates), statistics.median(batch_rates), same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args, target, device = pocket_benchmark(parser, tokens=48, prompts=8, threads=2)
    model = target.model
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(24, 72, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(3, target.config.vocab_size, (n,), generator=gen).to(device) for n in lengths]
    settings = DecodeSettings(max_new_tokens=args.tokens)
    proposers = random_proposers(target, device)
    # drafts right at random (scripted against the plain continuation): rows accept different lengths every round,
    # so the caches grow apart and rows finish in different rounds
    truth = {id(p): plain_generate(model, p[None], settings).tokens for p in prompts}

    def scripted(p):
        vocab = target.config.vocab_size
        return ScriptedProposer(truth[id(p)], len(p), [-1, 0, 0, 1, 2, 3], "sometimes", vocab, seed=len(p))

    # name: (proposer for one prompt, proposer for a batch)
    runs = {name: (lambda p, q=q: q, lambda ps, q=q: q) for name, q in proposers.items()}
    runs["scripted drafts right 60% of the time"] = (scripted, lambda ps: PerRow([scripted(p) for p in ps]))
    print(f"{args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens, {args.tokens} new tokens, {args.kernels}")
    one_plain, batch_plain, same = timed_runs(
        lambda p: plain_generate(model, p[None], settings),
        lambda ps: plain_generate_batch(model, ps, settings),
        prompts,
        args.batch,
        device,
        args.repeats,
    )
    print(
        f"plain: {one_plain:.1f} tok/s at batch 1, {batch_plain:.1f} at batch {args.batch} "
        f"({batch_plain / one_plain:.2f}x){'' if same else '  MISMATCH'}"
    )
    pooled_one = pooled_batch = 0.0
    failed = not same
    for name, (for_one, for_batch) in runs.items():
        one, batch, same = timed_runs(
            lambda p, make=for_one: speculative_generate(model, make(p), p[None], settings, args.kernels),
            lambda ps, make=for_batch: speculative_generate_batch(model, make(ps), ps, settings, args.kernels),
            prompts,
            args.batch,
            device,
            args.repeats,
        )
        failed |= not same
        pooled_one, pooled_batch = pooled_one + 1 / one, pooled_batch + 1 / batch
        print(
            f"{name}: {one:.1f} tok/s at batch 1, {batch:.1f} at batch {args.batch} ({batch / one:.2f}x); "
            f"vs plain at the same batch size {one / one_plain:.2f}x / {batch / batch_plain:.2f}x"
            f"{'' if same else '  MISMATCH'}"
        )
    if failed:
        sys.exit("batched decoding gave other tokens than decoding one prompt at a time")
    print(f"eval/batch_throughput: {pooled_one / pooled_batch:.2f} (goal >= {GOAL})")


if __name__ == "__main__":
    main()
