"""What `recipes/run.py` prints when a set's evaluations are done: the heading, the table of decoders (documentation
and general-chat columns) and what to serve, with the command that serves it."""

from __future__ import annotations

import json
from typing import Any

SETTINGS = {"temperature": "temperature", "batch_size": "batch", "num_prompts": "prompts", "max_new_tokens": "tokens"}
"""Report fields the table's heading states (from the first report); a row that differs says so."""


def heading(first: dict[str, Any]) -> str:
    decoding = "greedy" if not first.get("temperature") else f"sampled at temperature {first['temperature']}"
    return (
        f"{first['num_prompts']} held-out prompts, up to {first['max_new_tokens']} new tokens each, {decoding}, "
        f"batch {first.get('batch_size') or 1}; vs plain: each evaluation's own plain decoding"
    )


GENERAL = "-general"
"""The name suffix of a method's evaluation on the set's `general` prompts."""


def table(reports: dict[str, dict[str, Any]]) -> str:
    """One row per decoder: the plain baseline, prompt lookup (where measured), then each drafter; with evaluations on
    the set's `general` prompts (`<method>-general`), their τ and speedups in two more columns of the method's row."""
    from eval.report import lossless_mark, markdown_table

    general = {name.removesuffix(GENERAL): r for name, r in reports.items() if name.endswith(GENERAL)}
    reports = {name: r for name, r in reports.items() if not name.endswith(GENERAL)}
    first = next(iter(reports.values()))
    # the baselines' rows from the evaluation that measured prompt lookup beside plain decoding (else the first)
    base = next((r for r in reports.values() if r["tokens_per_s"].get("prompt_lookup")), first)
    plain = base["tokens_per_s"]["plain"]
    more = ["-", "1.00×"] if general else []
    rows = [["plain decoding", "-", "-", f"{plain:.1f}" if plain else "n/a", "1.00×", "-", *more]]
    lookup = base["tokens_per_s"].get("prompt_lookup")
    if lookup:
        ratio = f"{lookup / plain:.2f}×" if plain else "n/a"
        g = next((r["prompt_lookup_vs_plain"] for r in general.values() if r.get("prompt_lookup_vs_plain")), None)
        more = ["-", "n/a" if g is None else f"{g:.2f}×"] if general else []
        rows.append(["prompt lookup (transformers)", "-", "-", f"{lookup:.1f}", ratio, "-", *more])
    for name, r in reports.items():
        speed = r["tokens_per_s"]["speculative"]
        vs = r["speedup_vs_plain"]
        other = {k: r.get(k) for k in SETTINGS if r.get(k) != first.get(k)}  # a row decoded otherwise than the heading
        note = f" ({', '.join(f'{SETTINGS[k]} {v}' for k, v in other.items())})" if other else ""
        g = general.get(name)
        more = ["-", "-"] if g is None else [_ratio_cell(g["accept_len"], ""), _ratio_cell(g["speedup_vs_plain"])]
        rows.append(
            [
                f"{name}: {r['tree']}{note}",
                _ratio_cell(r["accept_len"], ""),
                " / ".join("-" if a is None else f"{a:.2f}" for a in r["accept_rate_by_depth"][:5]) or "-",
                f"{speed:.1f}",
                _ratio_cell(vs),
                f"{lossless_mark(r)} {r['lossless_prompts']}",
                *(more if general else []),
            ]
        )
    header = ["decoder", "τ", "acceptance by depth", "tok/s", "vs plain", "lossless"]
    if general:
        g = next(iter(general.values()))
        header += [f"τ, {g['num_prompts']} general prompts", "vs plain (general)"]
    return markdown_table(header, rows)


SWEEP_KEYS = ("eval.lookup_tokens", "eval.tree", "eval.head")
"""Eval settings of a winning configuration that the closing line names (they decide how it drafts)."""

SERVE_METHOD = {"eagle3": "eagle3", "eagle2": "eagle", "medusa1": "medusa", "medusa2": "medusa"}
"""vLLM's `speculative_config` method for each drafter method's `vllm` export (P-EAGLE: none yet)."""


def verdict(
    reports: dict[str, dict[str, Any]],
    methods: dict[str, str],
    target: str,
    runs: dict[str, str],
    settings: dict[str, list[str]] | None = None,
) -> str:
    """What to serve, by the measured speedups over plain decoding: the fastest lossless drafter evaluation, with the
    command that serves it; or, when transformers' prompt lookup was as fast or faster, prompt lookup, said plainly.
    `methods`: evaluation name -> drafter method; `runs`: method -> (its run directory or native export, where its
    vLLM export goes); `settings`: evaluation name -> its eval overrides (a sweep's tree settings: named when they
    win, since a serving engine drafts with its own tree)."""
    rows = {n: r for n, r in reports.items() if not n.endswith(GENERAL) and r.get("speedup_vs_plain") is not None}
    good = {n: r for n, r in rows.items() if r.get("lossless") is not False and r.get("acceptance") != "typical"}
    if not good:
        return "What to serve: no lossless drafter evaluation with a speed measurement; nothing to recommend."
    name, best = max(good.items(), key=lambda kv: kv[1]["speedup_vs_plain"])
    lookup = next((r["prompt_lookup_vs_plain"] for r in rows.values() if r.get("prompt_lookup_vs_plain")), None)
    if lookup is not None and lookup >= best["speedup_vs_plain"]:
        return (
            f"What to serve: prompt lookup. It beats every drafter here ({lookup:.2f}x plain decoding against "
            f"{name}'s {best['speedup_vs_plain']:.2f}x, τ {best['accept_len']:.2f}): the drafters do not pay for "
            "themselves on these prompts. vLLM: vllm serve TARGET --speculative-config "
            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'; or train on more data '
            "like these prompts."
        )
    method = methods[name]
    line = f"What to serve: {name} ({best['speedup_vs_plain']:.2f}x plain decoding, τ {best['accept_len']:.2f}"
    line += f"; prompt lookup {lookup:.2f}x)." if lookup is not None else ")."
    tree = [o for o in (settings or {}).get(name, []) if o.startswith(SWEEP_KEYS)]
    if tree:
        line += (f" It won with {', '.join(tree)}: `python -m eval RECIPE {' '.join(tree)}` decodes so; a serving "
                 "engine drafts with its own tree, so measure it there.")  # fmt: skip
    if method not in SERVE_METHOD:
        return line + f" vLLM has no loader for {method} drafters yet; serve it with `python -m eval`'s decoders."
    src, out = runs[method]
    config = json.dumps({"method": SERVE_METHOD[method], "model": out, "num_speculative_tokens": 3})
    return (
        f"{line} Export and serve it: python -m export {src} --format vllm --out {out} && vllm serve {target} "
        f"--speculative-config '{config}'"
    )


def _ratio_cell(value: float | None, unit: str = "×") -> str:
    return "n/a" if value is None else f"{value:.2f}{unit}"
