"""`eval.curve`: τ against data size from evaluation reports, the fitted trend and its prediction."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eval.curve import CurveError, fit, main, read_point


def report(directory: Path, tau: float) -> str:
    directory.mkdir(parents=True)
    (directory / "report.json").write_text(json.dumps({"accept_len": tau, "num_prompts": 4}))
    return str(directory)


def test_the_fit_recovers_a_logarithmic_trend_and_needs_three_sizes():
    points = [(n, 2.0 + 0.1 * math.log1p(n)) for n in (0, 1500, 3000, 6930)]
    a, b = fit(points)
    assert a == pytest.approx(2.0) and b == pytest.approx(0.1)
    assert fit(points[:2]) is None and fit([(10, 2.0), (10, 2.1), (20, 2.2)]) is None


def test_table_and_plot_from_reports(tmp_path, capsys):
    points = {n: 2.0 + 0.1 * math.log1p(n) for n in (0, 1500, 3000, 6930)}
    mt = [f"{n}={report(tmp_path / f'mt{n}', t)}" for n, t in points.items()]
    docs = [f"{n}={report(tmp_path / f'doc{n}', 3.4)}" for n in (0, 6930)]
    out = tmp_path / "curve.png"
    main(["--out", str(out), "--unit", "general answers", "--series", "MT-bench", *mt, "--series", "docs", *docs])
    printed = capsys.readouterr().out
    assert "| general answers | τ, MT-bench | τ, docs |" in printed
    assert "| 1,500 | 2.73 | – |" in printed and "| 6,930 | 2.88 | 3.40 |" in printed
    assert f"| predicted at 100,000 | {2.0 + 0.1 * math.log1p(100_000):.2f} | – |" in printed
    assert out.read_bytes().startswith(b"\x89PNG")


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
