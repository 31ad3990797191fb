"""τ against the amount of training data: a table, a fitted trend and a plot, from evaluation reports.

    python -m eval.curve --out docs/img/tau-vs-data.png --unit "general answers" \\
        --series "MT-bench" 0=RUN0/eval-mtbench 1500=RUN1/eval-mtbench ... \\
        --series "documentation" 0=RUN0/eval 1500=RUN1/eval ... [--predict 100000]

Each point is SIZE=DIR, DIR an evaluation's output directory (its `report.json`: `accept_len`, the mean accepted
length τ, and `per_prompt`, from which τ's standard error comes). Per series the trend τ = a + b·ln(1 + size) is
fitted by least squares (the sizes are spread over orders of magnitude; 1 + keeps a point at 0) and evaluated at
`--predict` with a 95% confidence interval; with fewer than three sizes there is no fit. Prints a markdown table (a
column per series, then the fit and its prediction) and writes the plot: the points with their standard errors, the
fitted line and its interval as a band.

The standard error of τ treats prompts as the independent units (rounds within one answer are not independent: a
loop accepts round after round): τ = Σ accepted / Σ rounds over prompts, a ratio of sums, with the usual
linearised variance. The fit's interval is the one of its mean at that size (Student t, n − 2 degrees of freedom,
from the scatter of the points about the line), so it widens fast with few sizes and far from them; it assumes
the logarithmic form, which cannot hold for ever: τ is at most the tree's depth + 1. `--ceiling` (that bound) caps
the prediction and the bands there, marks a capped prediction in the table and draws the bound.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import cache
from pathlib import Path
from typing import NamedTuple

REPORT = "report.json"
CONFIDENCE = 0.95


class CurveError(ValueError):
    """A point that cannot be read: the message names it."""


class Point(NamedTuple):
    size: int
    tau: float
    se: float | None
    """τ's standard error over prompts; None when the report has fewer than two prompts' rounds."""


def tau_standard_error(per_prompt: list[dict]) -> float | None:
    """Standard error of τ = Σ a_i / Σ r_i over prompts i (a_i accepted tokens, r_i rounds): prompts as clusters,
    sqrt(n / (n − 1) · Σ (a_i − τ r_i)²) / Σ r_i. None with fewer than two prompts that ran rounds."""
    rows = [(p["speculative"]["rounds"], p["speculative"]["rounds"] * p["speculative"]["accept_len"])
            for p in per_prompt if (p.get("speculative") or {}).get("rounds")]  # fmt: skip
    n, rounds = len(rows), sum(r for r, _ in rows)
    if n < 2:
        return None
    tau = sum(a for _, a in rows) / rounds
    return math.sqrt(n / (n - 1) * sum((a - tau * r) ** 2 for r, a in rows)) / rounds


def read_point(spec: str) -> Point:
    """ "SIZE=DIR" -> the point: size, τ of DIR/report.json and its standard error."""
    size, sep, directory = spec.partition("=")
    if not sep or not size.strip().isdigit():
        raise CurveError(f"{spec!r}: want SIZE=DIR (SIZE a whole number)")
    path = Path(directory) / REPORT
    try:
        report = json.loads(path.read_text())
        tau = float(report["accept_len"])
        se = tau_standard_error(report.get("per_prompt") or [])
    except FileNotFoundError:
        raise CurveError(f"{path}: no report (run the evaluation first)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CurveError(f"{path}: not an evaluation report ({exc.__class__.__name__}: {exc})") from None
    return Point(int(size), tau, se)


def fit(points: list[Point] | list[tuple[int, float]]) -> tuple[float, float] | None:
    """(a, b) of τ = a + b·ln(1 + size) by least squares, or None with fewer than three distinct sizes."""
    xs = [math.log1p(p[0]) for p in points]
    if len(set(xs)) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(p[1] for p in points) / len(points)
    b = sum((x - mx) * (p[1] - my) for x, p in zip(xs, points)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


@cache
def t_quantile(p: float, dof: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with `dof` degrees of freedom: bisection on its CDF, integrated by
    Simpson's rule (no scipy here)."""
    const = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)

    def cdf(x: float, steps: int = 2000) -> float:  # 0.5 + the integral of the density over [0, x]
        h = x / steps
        density = [const * (1 + (i * h) ** 2 / dof) ** (-(dof + 1) / 2) for i in range(steps + 1)]
        return 0.5 + h / 3 * (density[0] + density[-1] + 4 * sum(density[1:-1:2]) + 2 * sum(density[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def prediction(points: list[Point] | list[tuple[int, float]], size: float) -> tuple[float, float] | None:
    """The fit's τ at `size` and the half-width of its CONFIDENCE interval; None without a fit (a fit has three
    sizes or more, so at least one degree of freedom is left for the scatter)."""
    f = fit(points)
    if f is None:
        return None
    a, b = f
    xs = [math.log1p(p[0]) for p in points]
    n, x0 = len(points), math.log1p(size)
    value = a + b * x0
    mx = sum(xs) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    s2 = sum((p[1] - a - b * x) ** 2 for x, p in zip(xs, points)) / (n - 2)
    return value, t_quantile((1 + CONFIDENCE) / 2, n - 2) * math.sqrt(s2 * (1 / n + (x0 - mx) ** 2 / sxx))


def capped(guess: tuple[float, float], ceiling: float | None) -> tuple[float, float, float, bool]:
    """(value, low, high, whether the ceiling cut any of them) of a prediction and its half-width."""
    value, half = guess
    bounds = (value, value - half, value + half)
    if ceiling is None:
        return *bounds, False
    return *(min(v, ceiling) for v in bounds), bounds[2] > ceiling


def _cell(point: Point) -> str:
    return f"{point.tau:.2f}" + ("" if point.se is None else f" ± {point.se:.2f}")


def table(series: dict[str, list[Point]], unit: str, predict: int, ceiling: float | None = None) -> str:
    sizes = sorted({p.size for points in series.values() for p in points})
    lines = [f"| {unit} | " + " | ".join(f"τ, {name}" for name in series) + " |",
             "|---:|" + "---:|" * len(series)]  # fmt: skip
    for n in sizes:
        cells = [next((_cell(p) for p in points if p.size == n), "–") for points in series.values()]
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    fits = [fit(points) for points in series.values()]
    terms = ["–" if f is None else f"{f[0]:.2f} {'−' if f[1] < 0 else '+'} {abs(f[1]):.3f}·ln(1 + n)" for f in fits]
    lines.append("| fit τ = a + b·ln(1 + n) | " + " | ".join(terms) + " |")
    cells = []
    for points in series.values():
        guess = prediction(points, predict)
        if guess is None:
            cells.append("–")
        else:
            value, low, high, cut = capped(guess, ceiling)
            cells.append(f"{value:.2f} ({low:.2f}–{high:.2f}" + (f", capped at τ ≤ {ceiling:g})" if cut else ")"))
    lines.append(f"| predicted at {predict:,} ({CONFIDENCE:.0%} interval) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(series: dict[str, list[Point]], unit: str, predict: int, out: Path, ceiling: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, points in series.items():
        points = sorted(points, key=lambda p: p.size)
        errors = None if any(p.se is None for p in points) else [p.se for p in points]  # no bar rather than a 0 one
        line = ax.errorbar([p.size for p in points], [p.tau for p in points], yerr=errors, capsize=3, fmt="o-",
                           label=name).lines[0]  # fmt: skip
        guess = prediction(points, predict)
        if guess is not None:
            grid = [points[0].size + (predict - points[0].size) * i / 200 for i in range(201)]
            fits = [capped(prediction(points, n), ceiling) for n in grid]
            ax.plot(grid, [f[0] for f in fits], "--", color=line.get_color(), alpha=0.6,
                    label=f"{name}: fit, {capped(guess, ceiling)[0]:.2f} at {predict:,}")  # fmt: skip
            ax.fill_between(grid, [f[1] for f in fits], [f[2] for f in fits], color=line.get_color(), alpha=0.12,
                            linewidth=0)  # fmt: skip
    if ceiling is not None:
        sizes = [p.size for points in series.values() for p in points]  # (axhline would widen a symlog x axis to 0)
        ax.plot([min(sizes), max(*sizes, predict)], [ceiling] * 2, ":", color="0.3", linewidth=1,
                label=f"τ ≤ {ceiling:g} (the tree's depth + 1)")  # fmt: skip
    ax.set_xscale("symlog", linthresh=max(1, min(p.size for ps in series.values() for p in ps if p.size > 0)))
    ax.set_xlabel(unit)
    ax.set_ylabel("τ (mean accepted length)")
    ax.set_title(f"points ± standard error over prompts; bands: the fit's {CONFIDENCE:.0%} interval", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
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
    parser.add_argument("--ceiling", type=float, help="τ's bound, the tree's depth + 1: caps predictions and bands")
    args = parser.parse_args(argv)
    series: dict[str, list[Point]] = {}
    for name, *specs in args.series:
        if not specs:
            parser.error(f"--series {name}: no SIZE=DIR points")
        series[name] = [read_point(spec) for spec in specs]
        above = next((p for p in series[name] if args.ceiling is not None and p.tau > args.ceiling), None)
        if above is not None:
            parser.error(f"--series {name}: τ {above.tau:.2f} at {above.size:,} is above --ceiling {args.ceiling:g}")
    print(table(series, args.unit, args.predict, args.ceiling))
    plot(series, args.unit, args.predict, args.out, args.ceiling)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    try:
        main()
    except CurveError as exc:
        sys.exit(f"error: {exc}")
