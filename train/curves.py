"""A run's training curves as a picture: `curves.png` beside `metrics.jsonl`, redrawn whenever training checkpoints.

    python -m train.curves RUN_DIR          # draw it again from RUN_DIR/metrics.jsonl

Left: the training loss by step (each step, and a moving average over 5% of the steps) and the learning rate.
Right: the held-out top-1 accuracy by step (`eval/acc@1`, and the later unrolled steps' `eval/step<j>/acc@1` of
EAGLE-3 and P-EAGLE, or Medusa's `eval/acc@1/head<k>`), where the run evaluated its held-out samples.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

CURVES_FILE = "curves.png"
_ACC = re.compile(r"^eval/(?:(step\d+)/)?acc@1(?:/(head\d+))?$")  # EAGLE's unrolled steps, Medusa's heads


def read_metrics(path: Path) -> list[dict]:
    """Every complete line of a metrics file (a torn last line, from a killed run, is skipped)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]


def plot_curves(run_dir: str | Path) -> Path | None:
    """Draw `run_dir`/curves.png from its metrics.jsonl; its path, or None when there is nothing to draw."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.is_file() else []
    losses = [(r["step"], r["train/loss"]) for r in rows if isinstance(r.get("train/loss"), (int, float))]
    if not losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps, values = zip(*losses)
    left.plot(steps, values, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss")
    window = max(1, len(values) // 20)
    if window > 1:
        sums = [0.0, *itertools.accumulate(values)]
        smooth = [(sums[i + 1] - sums[max(0, i - window + 1)]) / (i + 1 - max(0, i - window + 1))
                  for i in range(len(values))]  # fmt: skip
        left.plot(steps, smooth, color="tab:blue", label=f"loss, mean of {window}")
    left.set_xlabel("step")
    left.set_ylabel("training loss")
    left.set_title(run_dir.name)
    lrs = [(r["step"], r["train/lr"]) for r in rows if isinstance(r.get("train/lr"), (int, float))]
    if lrs:
        twin = left.twinx()
        twin.plot(*zip(*lrs), color="tab:gray", linestyle=":", label="learning rate")
        twin.set_ylabel("learning rate")
    left.legend(loc="upper right", fontsize=8)
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for key, value in r.items():
            if (match := _ACC.match(key)) and isinstance(value, (int, float)):
                curves.setdefault(match.group(1) or match.group(2) or "step0", []).append((r["step"], value))
    for name, points in sorted(curves.items(), key=lambda kv: int(re.sub(r"\D", "", kv[0]) or 0)):
        right.plot(*zip(*points), marker="o", markersize=3, label=f"{name} acc@1")
    right.set_xlabel("step")
    right.set_ylabel("held-out top-1 accuracy")
    right.set_title("held-out accuracy" if curves else "held-out accuracy (not evaluated)")
    if curves:
        right.legend(fontsize=8)
    fig.tight_layout()
    out = run_dir / CURVES_FILE
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m train.curves RUN_DIR")
    out = plot_curves(args[0])
    if out is None:
        sys.exit(f"error: {args[0]}: no metrics.jsonl with training losses to draw")
    print(out)


if __name__ == "__main__":
    main()
