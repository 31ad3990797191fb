"""τ against the amount of training data: a table, a fitted trend and a plot, from evaluation reports.

    python -m eval.curve --out docs/img/tau-vs-data.png --unit "general answers" \\
        --series "MT-bench" 0=RUN0/eval-mtbench 1500=RUN1/eval-mtbench ... \\
        --series "documentation" 0=RUN0/eval 1500=RUN1/eval ... [--predict 100000]

Each point is SIZE=DIR, DIR an evaluation's output directory (its `report.json`: `accept_len`, the mean accepted
length τ). Per series the trend τ = a + b·ln(1 + size) is fitted by least squares (the sizes are spread over orders
of magnitude; 1 + keeps a point at 0) and evaluated at `--predict`; with fewer than three sizes there is no fit.
Prints a markdown table (a column per series, then the fit and its prediction) and writes the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPORT = "report.json"


class CurveError(ValueError):
    """A point that cannot be read: the message names it."""


def read_point(spec: str) -> tuple[int, float]:
    """ "SIZE=DIR" -> (size, τ of DIR/report.json)."""
    size, sep, directory = spec.partition("=")
    if not sep or not size.strip().isdigit():
        raise CurveError(f"{spec!r}: want SIZE=DIR (SIZE a whole number)")
    path = Path(directory) / REPORT
    try:
        report = json.loads(path.read_text())
        tau = float(report["accept_len"])
    except FileNotFoundError:
        raise CurveError(f"{path}: no report (run the evaluation first)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CurveError(f"{path}: not an evaluation report ({exc.__class__.__name__}: {exc})") from None
    return int(size), tau


def fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(a, b) of τ = a + b·ln(1 + size) by least squares, or None with fewer than three distinct sizes."""
    xs = [math.log1p(n) for n, _ in points]
    if len(set(xs)) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(t for _, t in points) / len(points)
    b = sum((x - mx) * (t - my) for x, (_, t) in zip(xs, points)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def table(series: dict[str, list[tuple[int, float]]], unit: str, predict: int) -> str:
    sizes = sorted({n for points in series.values() for n, _ in points})
    lines = [f"| {unit} | " + " | ".join(f"τ, {name}" for name in series) + " |",
             "|---:|" + "---:|" * len(series)]  # fmt: skip
    for n in sizes:
        cells = [next((f"{t:.2f}" for m, t in points if m == n), "–") for points in series.values()]
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    fits = [fit(points) for points in series.values()]
    lines.append("| fit τ = a + b·ln(1 + n) | " + " | ".join(
        "–" if f is None else f"{f[0]:.2f} + {f[1]:.3f}·ln(1 + n)" for f in fits) + " |")  # fmt: skip
    lines.append(f"| predicted at {predict:,} | " + " | ".join(
        "–" if f is None else f"{f[0] + f[1] * math.log1p(predict):.2f}" for f in fits) + " |")  # fmt: skip
    return "\n".join(lines)


def plot(series: dict[str, list[tuple[int, float]]], unit: str, predict: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, points in series.items():
        points = sorted(points)
        (line,) = ax.plot([n for n, _ in points], [t for _, t in points], "o-", label=name)
        f = fit(points)
        if f is not None:
            grid = [points[0][0] + (predict - points[0][0]) * i / 200 for i in range(201)]
            ax.plot(grid, [f[0] + f[1] * math.log1p(n) for n in grid], "--", color=line.get_color(), alpha=0.6,
                    label=f"{name}: fit, {f[0] + f[1] * math.log1p(predict):.2f} at {predict:,}")  # fmt: skip
    ax.set_xscale("symlog", linthresh=max(1, min(n for p in series.values() for n, _ in p if n > 0)))
    ax.set_xlabel(unit)
    ax.set_ylabel("τ (mean accepted length)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.curve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--series", nargs="+", action="append", required=True, metavar=("NAME", "SIZE=DIR"))
    parser.add_argument("--out", type=Path, required=True, help="the plot (.png)")
    parser.add_argument("--unit", default="training samples", help="what the sizes count (the x axis)")
    parser.add_argument("--predict", type=int, default=100_000, help="the size to extrapolate the fit to")
    args = parser.parse_args(argv)
    series: dict[str, list[tuple[int, float]]] = {}
    for name, *specs in args.series:
        if not specs:
            parser.error(f"--series {name}: no SIZE=DIR points")
        series[name] = [read_point(spec) for spec in specs]
    print(table(series, args.unit, args.predict))
    plot(series, args.unit, args.predict, args.out)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    try:
        main()
    except CurveError as exc:
        sys.exit(f"error: {exc}")
