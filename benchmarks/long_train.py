"""Peak memory of an EAGLE-3 training step on long packed rows: linear in the row length, within a 24 GB machine.

    .venv/bin/python -m benchmarks.long_train [--lengths 1024 2048 4096 8192] [--rows 1] [--ttt-steps 3]

One training step (forward, backward, AdamW step) of the SmolLM2 EAGLE-3.1 drafter's shape (d 576, 9 / 3 heads,
vocabulary 49,152, draft vocabulary 16,000, 3 unrolled steps, the recipe's settings) on `--rows` rows of each length,
each length in a fresh process: the memory the step adds (resident memory sampled during the step, above what it was
before) and the process's peak (ru_maxrss, start-up included), which is the goal's figure. The target is a random-init
Llama with SmolLM2's config (its embedding and lm_head are what the drafter borrows; the 30 layers are never run: the
batch carries stored features of SmolLM2's width), so no download and no feature shards are needed: memory depends on
shapes, not on values. It prints each length's peak and step time, the growth per doubling of the length, and ends
with `long_train/peak_gb_at_4096: <GB> (goal <= 24)`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

GOAL_GB = 24.0
SMOLLM2 = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
LAYERS = [2, 15, 27, -1]


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


class PeakWatch:
    """The most resident memory seen while the block runs (sampled every 2 ms), above what it was at the start."""

    def __enter__(self):
        self.start, self.peak, self.running = rss_gb(), 0.0, True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_gb())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_gb())

    @property
    def added(self) -> float:
        return self.peak - self.start


def one_step(length: int, rows: int, ttt_steps: int, draft_vocab: int) -> dict:
    """Build the drafter, run one optimizer step on `rows` packed rows of `length` tokens; peak RSS in GB."""
    import torch

    from methods.eagle3.config import Eagle3Config
    from methods.eagle3.model import Eagle3Drafter
    from models.target import load_target

    torch.manual_seed(0)
    target = load_target(random_init=SMOLLM2, dtype="bfloat16")
    for layer in target.model.model.layers:  # never run here: free their weights, keep embedding and lm_head
        layer.to("meta")
    cfg = Eagle3Config(draft_vocab=draft_vocab, ttt_steps=ttt_steps, fc_norm=True, norm_output=True)
    drafter = Eagle3Drafter(cfg, target.parts(LAYERS)).train()
    drafter.set_draft_vocab(torch.randperm(SMOLLM2["vocab_size"])[:draft_vocab], init_head=True)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    d, sample = SMOLLM2["hidden_size"], 256  # packed samples of 256 tokens, positions restarting at 0
    positions = (torch.arange(length) % sample).expand(rows, length)
    batch = {
        "input_ids": torch.randint(0, SMOLLM2["vocab_size"], (rows, length)),
        "loss_mask": (positions >= 32).float(),  # a 32-token prompt per sample without loss
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "position_ids": positions.contiguous(),
        "hidden": torch.randn(rows, length, len(LAYERS), d, dtype=torch.bfloat16),
    }
    start = time.perf_counter()
    with PeakWatch() as watch:
        out = drafter(batch)
        out["loss"].backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KB -> GB, the process's lifetime peak
    return {"length": length, "rows": rows, "peak_gb": peak, "step_gb": watch.added, "step_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=16000)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child process: one length
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_step(args.one, args.rows, args.ttt_steps, args.draft_vocab)))
        return
    results = []
    for length in args.lengths:
        cmd = [sys.executable, "-m", "benchmarks.long_train", "--one", str(length), "--rows", str(args.rows)]
        cmd += ["--ttt-steps", str(args.ttt_steps), "--draft-vocab", str(args.draft_vocab)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"long_train: length {length} failed:\n{done.stderr[-2000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(r)
        print(
            f"{length:>6} tokens x {r['rows']} row(s): the step adds {r['step_gb']:.2f} GB, process peak "
            f"{r['peak_gb']:.2f} GB, step {r['step_s']:.1f} s"
        )
    for a, b in zip(results, results[1:]):
        growth = b["step_gb"] / max(a["step_gb"], 1e-9)
        print(f"{a['length']} -> {b['length']} tokens: the step's memory x{growth:.2f} (linear: x2, quadratic: x4)")
    at = next((r for r in results if r["length"] == 4096), results[-1])
    print(f"long_train/peak_gb_at_{at['length']}: {at['peak_gb']:.2f} (goal <= {GOAL_GB:.0f})")


if __name__ == "__main__":
    main()
