"""Overhead of the speculative decoding loop itself: wall time ÷ (target forwards + drafter forwards).

    .venv/bin/python benchmarks/eval_overhead.py [--target recipes/pocket/target] [--kernels reference] [--tokens 64]

Everything that is neither a target forward nor a drafter forward is the loop's: tree building, verification,
KV commit, bookkeeping. Runs an EAGLE-2 drafter (dynamic tree) and Medusa heads (calibrated-shape static tree)
with random weights on the pocket target (or, when it is absent, a random model of the same shape), greedy, and
ends with `eval/overhead: X (goal <= 1.15)` pooled over both. Single-threaded: timings are steadier.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.decode import DecodeSettings, speculative_generate  # noqa: E402
from eval.eagle_proposer import EagleProposer  # noqa: E402
from eval.static_proposers import MedusaProposer  # noqa: E402
from eval.target_runner import clock  # noqa: E402
from eval.trees import calibrated_tree, medusa_rank_acc  # noqa: E402
from methods.eagle2.model import EagleConfig, EagleDrafter  # noqa: E402
from methods.medusa1.model import MedusaConfig, MedusaHeads  # noqa: E402
from models.target import Target, load_target  # noqa: E402

POCKET_SHAPE = {
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
GOAL = 1.15


def pocket_target(path: str):
    """(the fp32 target at `path`, or a random model of the pocket target's shape when it is absent; its device)."""
    if (Path(path) / "config.json").is_file():
        target = load_target(path=path, dtype="float32")
    else:
        print(f"no target at {path}: a random model of the pocket target's shape")
        target = load_target(random_init=POCKET_SHAPE, dtype="float32")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target.model.to(device)
    return target, device


def pocket_benchmark(
    parser: argparse.ArgumentParser, tokens: int, prompts: int, threads: int
) -> tuple[argparse.Namespace, Target, str]:
    """(args, target, device) for a decoding benchmark on the pocket target: adds the options they all take
    (--target, --kernels, --tokens, --prompts, --threads, with these defaults) to `parser`, parses the command
    line, sets the thread count and seed 0 (random drafters start from the same weights every run)."""
    parser.add_argument("--target", default=str(ROOT / "recipes/pocket/target"))
    parser.add_argument("--kernels", default="triton" if torch.cuda.is_available() else "reference")
    parser.add_argument("--tokens", type=int, default=tokens, help="new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--threads", type=int, default=threads)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return args, *pocket_target(args.target)


def random_proposers(target: Target, device: str) -> dict[str, EagleProposer | MedusaProposer]:
    """name -> proposer for the drafters the decoding benchmarks run, with random weights: an EAGLE-2 drafter
    (dynamic tree: depth 3, top-2, 6 tokens) and 3 Medusa heads (a calibrated-shape tree of 6 tokens)."""
    eagle = EagleDrafter(EagleConfig(), target.parts([-1])).to(device).eval()
    medusa = MedusaHeads(MedusaConfig(num_heads=3), target.parts([-1])).to(device).eval()
    return {
        "eagle2 dynamic d3 k2 n6": EagleProposer(eagle, depth=3, top_k=2, total_tokens=6),
        "medusa1 calibrated n6": MedusaProposer(medusa, calibrated_tree(medusa_rank_acc(top_k=3)[:3], 5)),
    }


def timed(fn, total: list[float], device: str):
    """`fn` that adds its own run time (device work included: `eval.target_runner.clock`) to total[0]."""

    def wrapper(*args, **kwargs):
        start = clock(device)
        out = fn(*args, **kwargs)
        total[0] += clock(device) - start
        return out

    return wrapper


def measure(model, proposer, drafter_time: list[float], prompts: list[torch.Tensor], settings, kernels: str) -> tuple:
    """(wall, target forward time, drafter forward time, generated tokens) over the prompts, after a warm-up."""
    speculative_generate(model, proposer, prompts[0], DecodeSettings(max_new_tokens=4), kernels)
    drafter_time[0] = 0.0
    wall = target = tokens = 0.0
    for ids in prompts:
        out = speculative_generate(model, proposer, ids, settings, kernels)
        wall, target, tokens = wall + out.wall_s, target + out.target_s, tokens + len(out.tokens)
    return wall, target, drafter_time[0], tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args, target, device = pocket_benchmark(parser, tokens=64, prompts=4, threads=1)
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (1, 48), generator=gen).to(device) for _ in range(args.prompts)]
    settings = DecodeSettings(max_new_tokens=args.tokens)

    runs = {}  # name: (proposer, its drafter's forward time)
    for name, proposer in random_proposers(target, device).items():
        drafter_time = [0.0]
        # the drafter's forward, timed on the instance: the proposer looks it up at every call
        if isinstance(proposer, EagleProposer):
            proposer.drafter.step = timed(proposer.drafter.step, drafter_time, device)
        else:
            proposer.heads.head_logits = timed(proposer.heads.head_logits, drafter_time, device)
        runs[name] = (proposer, drafter_time)
    total_wall = total_work = 0.0
    for name, (proposer, drafter_time) in runs.items():
        wall, target_s, draft_s, tokens = measure(target.model, proposer, drafter_time, prompts, settings, args.kernels)
        total_wall, total_work = total_wall + wall, total_work + target_s + draft_s
        print(
            f"{name}: {tokens:.0f} tokens in {wall:.2f}s; target forwards {target_s:.2f}s, drafter forwards "
            f"{draft_s:.2f}s, loop {wall - target_s - draft_s:.2f}s -> overhead {wall / (target_s + draft_s):.3f}"
        )
    print(f"eval/overhead: {total_wall / total_work:.2f} (goal <= {GOAL})")


if __name__ == "__main__":
    main()
