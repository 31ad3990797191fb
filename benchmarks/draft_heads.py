"""Two-stage head recall for each draft head of a trained run (any method trained on feature shards): how often the
full head's top tokens survive the screen.

    .venv/bin/python -m benchmarks.draft_heads artifacts/smollm2-run/medusa1 [--rank 64] [--candidates 256]

For every head the drafter lists (`draft_heads()`: EAGLE one, Medusa one per head), factors are fitted exactly as
`python -m export` fits them (`models.lm_head.fit_samples`: the first samples of the run's feature shards, here
only training ones, and their loss-token counts), then evaluated on what the head reads at the loss positions of the
run's *held-out* samples (`heldout.json`, else the last 5% of the shards): top-1 recall = the fraction of positions
whose full-head best token is among the candidates, top-4 recall = the same for each of its 4 best. FLOP ratio as
in `benchmarks/lm_head.py`. Goal: the worst head's top-1 recall >= 0.98.

Measured (SmolLM2, 4,000 held-out positions): Medusa-1's three heads 0.92-0.94 at rank 64 / 256 candidates (0.12 of
the FLOPs), 0.98-0.99 at rank 128 (0.23): `draft_heads/top1_recall: 0.9800 (goal >= 0.98)`; the EAGLE-2 run's
head (the target's lm_head) 0.963 at rank 64.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from data.heldout import read_heldout
from data.shards import FeatureDataset
from eval.heads import TwoStageHead, shard_fit_data
from export.write import load_run
from models.lm_head import compute_factors

POSITIONS = 4000


def split(features: FeatureDataset, run_dir: Path) -> tuple[list[int], list[int]]:
    """(fitting, held-out) sample indices: the run's held-out samples (`heldout.json`, else the last 5%), the rest."""
    ids = set(read_heldout(run_dir) or [])
    heldout = [i for i, s in enumerate(features.sample_ids) if s in ids]
    heldout = heldout or list(range(len(features) - max(1, len(features) // 20), len(features)))
    kept = set(heldout)
    return [i for i in range(len(features)) if i not in kept], heldout


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.draft_heads", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--candidates", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    recipe, target, drafter = load_run(run_dir)
    features = FeatureDataset(recipe.data.features_dir, verify_checksums=False)
    fit_idx, test_idx = split(features, run_dir)
    fit, counts, _ = shard_fit_data(features, drafter, target.config.vocab_size, fit_idx)
    test = [{**s, "loss_mask": s["loss_mask"] > 0} for s in (features[i] for i in test_idx)]
    recalls = []  # one per head: no head, or a head with no held-out position (nan), cannot pass
    print(f"{run_dir}: {recipe.drafter.method}, rank {args.rank}, {args.candidates} candidates, "
          f"{len(fit)} fitting samples, {len(test)} held-out")  # fmt: skip
    for head in drafter.draft_heads():
        factors = compute_factors(head, fit, counts, args.rank)
        weight = head.weight.detach().float()
        two = TwoStageHead(weight, factors, args.candidates)
        h = torch.cat([head.inputs(s) for s in test])[:POSITIONS]  # (N, d)
        top4 = (h @ weight.T).topk(4, dim=-1).indices  # (N, 4)
        found = (two(h)[0][:, :, None] == top4[:, None, :]).any(1)  # (N, 4): each top token among the candidates
        top1, all4 = found[:, 0].float().mean().item(), found.float().mean().item()
        recalls.append(top1 if top1 == top1 else 0.0)
        print(f"  {head.name}: {len(h)} positions, top-1 recall {top1:.4f}, top-4 recall {all4:.4f}, "
              f"FLOPs {two.flops_ratio():.3f} of the full head")  # fmt: skip
    print(f"draft_heads/top1_recall: {min(recalls, default=0.0):.4f} (goal >= 0.98)")


if __name__ == "__main__":
    main()
