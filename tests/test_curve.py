"""`eval.curve`: τ against data size from evaluation reports, the fitted trend and its prediction."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from eval.curve import CurveError, Point, capped, fit, main, prediction, read_point, t_quantile, tau_standard_error


def report(directory: Path, tau: float, per_prompt: list[tuple[int, float]] = ()) -> str:
    """An evaluation report of τ; `per_prompt`: (rounds, τ) of each prompt."""
    directory.mkdir(parents=True)
    rows = [{"speculative": {"rounds": r, "accept_len": t}} for r, t in per_prompt]
    (directory / "report.json").write_text(json.dumps({"accept_len": tau, "num_prompts": 4, "per_prompt": rows}))
    return str(directory)


def test_the_fit_recovers_a_logarithmic_trend_and_needs_three_sizes():
    points = [(n, 2.0 + 0.1 * math.log1p(n)) for n in (0, 1500, 3000, 6930)]
    a, b = fit(points)
    assert a == pytest.approx(2.0) and b == pytest.approx(0.1)
    assert fit(points[:2]) is None and fit([(10, 2.0), (10, 2.1), (20, 2.2)]) is None


def test_table_and_plot_from_reports(tmp_path, capsys):
    points = {n: 2.0 + 0.1 * math.log1p(n) for n in (0, 1500, 3000, 6930)}
    mt = [f"{n}={report(tmp_path / f'mt{n}', t)}" for n, t in points.items()]
    docs = [f"{n}={report(tmp_path / f'doc{n}', 3.4, [(5, 3.0), (5, 3.8)])}" for n in (0, 6930)]  # ± 0.4
    out = tmp_path / "curve.png"
    main(["--out", str(out), "--unit", "general answers", "--series", "MT-bench", *mt, "--series", "docs", *docs])
    printed = capsys.readouterr().out
    assert "| general answers | τ, MT-bench | τ, docs |" in printed
    assert "| 1,500 | 2.73 | – |" in printed and "| 6,930 | 2.88 | 3.40 ± 0.40 |" in printed
    assert "| fit τ = a + b·ln(1 + n) | 2.00 + 0.100·ln(1 + n) | – |" in printed
    at = f"{2.0 + 0.1 * math.log1p(100_000):.2f}"
    assert f"| predicted at 100,000 (95% interval) | {at} ({at}–{at}) | – |" in printed  # on the line: no width
    assert out.read_bytes().startswith(b"\x89PNG")
    # a size measured twice, one report without per-prompt rounds: drawn without error bars, no comparison of None
    again = [f"0={report(tmp_path / 'again', points[0])}", f"0={report(tmp_path / 'again2', points[0], [(2, 2.0)])}"]
    main(["--out", str(out), "--series", "MT-bench", *mt, *again])


def test_the_ceiling_caps_the_prediction_and_refuses_a_point_above_it(tmp_path, capsys):
    assert capped((4.5, 1.0), None) == (4.5, 3.5, 5.5, False)
    assert capped((4.5, 1.0), 5.0) == (4.5, 3.5, 5.0, True)
    assert capped((5.5, 1.0), 5.0) == (5.0, 4.5, 5.0, True)
    assert capped((3.0, 0.5), 5.0) == (3.0, 2.5, 3.5, False)
    # τ = 1 + 0.3·ln(1 + n) reaches 4.45 at 100,000; with scatter, its interval crosses 4.5
    points = {n: 1.0 + 0.3 * math.log1p(n) + d for n, d in ((1000, 0.05), (3000, -0.05), (10000, 0.05), (20000, -0.05))}
    specs = [f"{n}={report(tmp_path / f'p{n}', t)}" for n, t in points.items()]
    out = tmp_path / "curve.png"
    main(["--out", str(out), "--ceiling", "4.5", "--series", "chat", *specs])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| predicted"))
    assert row.endswith("–4.50, capped at τ ≤ 4.5) |"), row
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--ceiling", "3", "--series", "chat", *specs])
    assert "τ 3.12 at 1,000 is above --ceiling 3" in capsys.readouterr().err


@pytest.mark.parametrize("spec, match", [
    ("1500", "want SIZE=DIR"),
    ("many={tmp}", "want SIZE=DIR"),
    ("10={tmp}/none", "none/report.json: no report"),
    ("10={tmp}/bad", "bad/report.json: not an evaluation report"),
])  # fmt: skip
def test_a_point_that_cannot_be_read_is_named(spec, match, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "report.json").write_text('{"tau": 3}')
    with pytest.raises(CurveError, match=match):
        read_point(spec.format(tmp=tmp_path))


def test_tau_standard_error_counts_prompts_not_rounds(tmp_path):
    """τ = Σ accepted / Σ rounds; its standard error treats each prompt as one unit: (2 rounds at τ 1, 2 at τ 3) is
    τ 2 with residuals ∓2 per prompt, sqrt(2 / 1 · 8) / 4 = 1. Prompts without rounds do not count."""
    assert tau_standard_error([{"speculative": {"rounds": 2, "accept_len": 1.0}},
                               {"speculative": {"rounds": 2, "accept_len": 3.0}},
                               {"speculative": {"rounds": 0, "accept_len": None}}]) == pytest.approx(1.0)  # fmt: skip
    # weighted by rounds: (1 round at τ 1, 3 at τ 3) is τ 2.5, residuals -1.5, +1.5: sqrt(2 · 4.5) / 4 = 0.75
    # (the plain standard error of the two prompts' τ would be 1.0)
    assert tau_standard_error([{"speculative": {"rounds": 1, "accept_len": 1.0}},
                               {"speculative": {"rounds": 3, "accept_len": 3.0}}]) == pytest.approx(0.75)  # fmt: skip
    assert tau_standard_error([{"speculative": {"rounds": 5, "accept_len": 2.0}}] * 3) == 0.0
    assert tau_standard_error([{"speculative": {"rounds": 5, "accept_len": 2.0}}]) is None
    point = read_point(f"1500={report(tmp_path / 'r', 2.0, [(2, 1.0), (2, 3.0)])}")
    assert point == Point(1500, 2.0, pytest.approx(1.0))


@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995])
def test_t_quantile_matches_the_closed_forms(p):
    """Student t's quantile has closed forms at 1 degree of freedom (Cauchy) and at 2; 2.228 at 10 (tables)."""
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-5)
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-5)
    assert t_quantile(0.975, 10) == pytest.approx(2.2281, abs=1e-4)


def test_the_prediction_interval_is_the_regression_one():
    """The half-width equals t · sqrt(s² x0ᵀ (XᵀX)⁻¹ x0) computed by matrices, for scattered points; it grows away
    from the sizes measured."""
    points = [(3072, 1.66), (4572, 2.05), (6072, 2.21), (10002, 2.31)]
    X = torch.tensor([[1.0, math.log1p(n)] for n, _ in points], dtype=torch.float64)
    y = torch.tensor([t for _, t in points], dtype=torch.float64)
    beta = torch.linalg.solve(X.T @ X, X.T @ y)
    s2 = float(((y - X @ beta) ** 2).sum()) / (len(points) - 2)
    for size in (5000, 100_000):
        x0 = torch.tensor([1.0, math.log1p(size)], dtype=torch.float64)
        value, half = prediction(points, size)
        assert value == pytest.approx(float(x0 @ beta))
        assert half == pytest.approx(4.302653 * math.sqrt(s2 * float(x0 @ torch.linalg.solve(X.T @ X, x0))), rel=1e-5)
    assert prediction(points, 100_000)[1] > 3 * prediction(points, 5000)[1]
    assert prediction(points[:2], 100_000) is None
