"""Two-stage LM head (`eval.heads`) on a real head: recall of the full head's top tokens, time and FLOPs.

    .venv/bin/python -m benchmarks.lm_head [--positions 4096] [--batch 8] [--repeats 5] [--threads 1]

Setup: SmolLM2-135M-Instruct's tied embedding (`model.embed_tokens.weight`, 49,152 x 576, bf16, computed in
float32) from artifacts/smollm2-135m-instruct; token frequencies = loss-token counts of the self-distilled
answers' features (artifacts/smollm2-run/features) over the training split of their samples (the split training
uses, `FeatureDataset.split(0.05)`), and hidden states = the stored last hidden state (after the final norm: what
the head reads) at loss positions of the *held-out* samples, so the frequencies never saw the evaluated tokens.
Without those artifacts (`make smollm2`) it cannot measure: random hidden states and uniform frequencies say nothing
about the goal, so it prints that, a goal line `n/a`, and exits with status 1 (as `benchmarks/lowrank_topk.py` does).

Factors (`models.lm_head.factorize`), three variants: "freq" (frequency-weighted SVD of W), "freq+moment" (also
fitted to the logits of the hidden-state distribution: E[h·hᵀ] of training-split hidden states) and "moment" (the
latter without frequency weights). For each variant and (rank, candidates) setting: recall = the fraction of
positions whose full-head top-1 (top-4: each of the top-4 tokens) is among the candidates; time per token of
stage 1 + stage 2 (`TwoStageHead.__call__`) against the full projection `h @ Wᵀ`, in calls of `--batch` tokens
(default 8: about one layer of an EAGLE-2 draft tree), best of `--repeats` (1 thread); FLOP ratio =
((V + d)·r + C·d) / (V·d), top-k selection not counted (it is what keeps the measured ratio above the FLOP ratio:
a top-256 of 49,152 scores costs about as much as stage 1's matmuls at rank 64 on one core).
Goal: among all settings measured at <= 0.25 of the full head's time, the best top-1 recall >= 0.98.

Measured (2 shared cores, 1 thread): full head 2.56 ms/token; "freq" reaches only 0.86 top-1 recall at rank 64 /
256 candidates (0.24 of the time); the hidden moment lifts it to 0.97 ("freq+moment") and 0.98 ("moment"): on these
held-out answers the sqrt(count + 1) weights cost recall once the fit is data-aware.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from data.shards import FeatureDataset
from eval.heads import TwoStageHead
from models.lm_head import factorize, hidden_moment, token_weights

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "artifacts/smollm2-135m-instruct/model.safetensors"
FEATURES = ROOT / "artifacts/smollm2-run/features"
SETTINGS = [(32, 256), (48, 256), (64, 256), (64, 512), (96, 256), (96, 512), (128, 512)]
HELDOUT = 0.05
MOMENT_SAMPLES = 100  # training-split samples whose hidden states (all positions, ~15k) give E[h·hᵀ]


def load_head(path: Path) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        key = "model.embed_tokens.weight" if "model.embed_tokens.weight" in f.keys() else "lm_head.weight"
        return f.get_tensor(key).to(torch.float32)  # (V, d)


def real_data(vocab: int, positions: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts (V,) over the training split's loss tokens, held-out hidden states (positions, d), E[h·hᵀ] (d, d)
    over the hidden states of the first MOMENT_SAMPLES training samples)."""
    # the checksums are the extraction's business; the benchmark only reads
    ds = FeatureDataset(FEATURES, verify_checksums=False)
    train, heldout = ds.split(HELDOUT)
    held_ids = {ds.sample_ids[i] for i in heldout}
    counts = torch.zeros(vocab, dtype=torch.int64)
    for entry in ds.shards:
        with safe_open(str(ds.directory / entry["file"]), framework="pt") as shard:
            ids = shard.get_tensor("input_ids").to(torch.int64)  # (T,)
            mask = shard.get_tensor("loss_mask") > 0  # (T,)
            offsets = shard.get_tensor("offsets")  # (n + 1,)
            for k, sample_id in enumerate(shard.get_tensor("sample_ids").tolist()):
                if sample_id not in held_ids:
                    a, b = int(offsets[k]), int(offsets[k + 1])
                    counts += torch.bincount(ids[a:b][mask[a:b]], minlength=vocab)
    hidden = []
    for i in heldout:
        sample = ds[i]
        hidden.append(sample["hidden"][:, -1][sample["loss_mask"] > 0].to(torch.float32))  # (loss tokens, d)
        if sum(len(x) for x in hidden) >= positions:
            break
    moment = hidden_moment(torch.cat([ds[i]["hidden"][:, -1] for i in train[:MOMENT_SAMPLES]]))
    return counts, torch.cat(hidden)[:positions], moment


def best_time(fn, h: torch.Tensor, batch: int, repeats: int) -> float:
    """Seconds per token: best over `repeats` passes over h in calls of `batch` tokens."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(h), batch):
            fn(h[i : i + batch])
        best = min(best, (time.perf_counter() - start) / len(h))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=4096, help="hidden states evaluated for recall")
    parser.add_argument("--timed", type=int, default=512, help="of those, how many are timed")
    parser.add_argument("--batch", type=int, default=8, help="tokens per head call in the timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    missing = [path for path in (TARGET, FEATURES / "manifest.json") if not path.is_file()]
    if missing:  # recall on random hidden states measures nothing the goal is about
        print(f"cannot measure: {', '.join(str(p) for p in missing)} absent (make smollm2): the goal is measured on")
        print("SmolLM2's head with the frequencies and held-out hidden states of its features, not on random data")
        print("lm_head/top1_recall_at_quarter_cost: n/a (goal >= 0.98)")
        sys.exit(1)
    weight = load_head(TARGET)
    counts, hidden, moment = real_data(weight.shape[0], args.positions)
    source = (
        f"SmolLM2-135M tied embedding; frequencies from {int(counts.sum()):,} training-split loss tokens; "
        f"{len(hidden)} held-out hidden states"
    )
    vocab, d = weight.shape
    print(f"{source}; head {vocab} x {d}, {torch.get_num_threads()} thread(s), calls of {args.batch} tokens")

    full_logits = hidden @ weight.T  # (N, V)
    top4 = full_logits.topk(4, dim=-1).indices  # (N, 4)
    del full_logits
    timed = hidden[: args.timed].contiguous()
    full_time = best_time(lambda x: x @ weight.T, timed, args.batch, args.repeats)
    print(f"full head: {full_time * 1e6:.1f} us/token")

    weights = token_weights(counts)
    variants = {
        "freq": {"weights": weights},
        "freq+moment": {"weights": weights, "hidden_moment": moment},
        "moment": {"hidden_moment": moment},
    }
    factors = {}
    best = None
    for (rank, candidates), variant in [(s, v) for v in variants for s in SETTINGS]:
        if (rank, variant) not in factors:
            factors[rank, variant] = factorize(weight, rank, **variants[variant])
        head = TwoStageHead(weight, factors[rank, variant], candidates)
        ids = torch.cat([head(hidden[i : i + 1024])[0] for i in range(0, len(hidden), 1024)])  # (N, C)
        hit = (ids[:, :, None] == top4[:, None, :]).any(dim=1)  # (N, 4): is each full top-4 token a candidate
        recall1, recall4 = hit[:, 0].float().mean().item(), hit.float().mean().item()
        t = best_time(head, timed, args.batch, args.repeats)
        ratio = t / full_time
        print(
            f"{variant:11s} rank {rank:4d} candidates {candidates:5d}: "
            f"top1 recall {recall1:.4f}, top4 recall {recall4:.4f}, "
            f"{t * 1e6:7.1f} us/token = {ratio:.3f} of full, FLOP ratio {head.flops_ratio():.3f}"
        )
        if ratio <= 0.25 and (best is None or recall1 > best[0]):
            best = (recall1, rank, candidates, variant)
    if best is None:
        print("no setting ran within 0.25 of the full head's time")
        best = (0.0,)
    else:
        print(f"best setting within 0.25 of the full head's time: {best[3]}, rank {best[1]}, candidates {best[2]}")
    print(f"lm_head/top1_recall_at_quarter_cost: {best[0]:.4f} (goal >= 0.98)")


if __name__ == "__main__":
    main()
