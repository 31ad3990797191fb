"""Summaries of an evaluation run: `report.json`, `report.md` (markdown tables) and `report.png`.

    summary = summarize(records, meta)      # records: one dict per prompt, from eval.run.evaluate_batch
    write_report(summary, "runs/x/eval")    # report.json, report.md, report.png

Speeds are pooled over prompts (total new tokens / total wall time per method), τ is pooled over
every verification round of every prompt (mean of accepted + 1), per-depth conditional acceptance
pools the rounds too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from data.repeats import REPEAT_NGRAM
from eval.decode import round_stats

METHODS = ("plain", "speculative", "prompt_lookup")


def _speed(records: list[dict[str, Any]], method: str) -> float | None:
    runs = [r[method] for r in records if method in r]
    if not runs:
        return None
    return sum(x["new_tokens"] for x in runs) / max(sum(x["wall_s"] for x in runs), 1e-9)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(records: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """Pool per-prompt records into the report (meta: method, tree, settings... copied as they are)."""
    records = sorted(records, key=lambda r: r["index"])
    accepted = [a for r in records for a in r["speculative"]["accepted"]]
    extendable = [e for r in records for e in r["speculative"]["extendable"]]
    speed = {m: _speed(records, m) for m in METHODS}
    checked = [r["lossless"] for r in records if r.get("lossless") is not None]
    # lossless prompts whose output went another way at a near-tie (a prompt that fails later is a failure)
    ties = [r["near_tie"] for r in records if r.get("lossless") and r.get("near_tie") and r["near_tie"]["tie"]]
    spec_tokens = sum(r["speculative"]["new_tokens"] for r in records)
    return {
        **meta,
        "num_prompts": len(records),
        **round_stats(accepted, extendable),
        "forwards_per_token": sum(r["speculative"]["target_forwards"] for r in records) / max(spec_tokens, 1),
        "tokens_per_s": speed,
        "speedup_vs_plain": _ratio(speed["speculative"], speed["plain"]),
        "speedup_vs_prompt_lookup": _ratio(speed["speculative"], speed["prompt_lookup"]),
        "prompt_lookup_vs_plain": _ratio(speed["prompt_lookup"], speed["plain"]),
        "lossless": all(checked) if checked else None,
        "lossless_prompts": (f"{sum(checked)}/{len(checked)}" + (f" ({len(ties)} at a near-tie)" if ties else ""))
        if checked
        else ("n/a (sampled)" if meta.get("temperature") else "n/a (no plain baseline)"),
        "near_ties": len(ties),
        "near_tie_margins": [t["margin"] for t in ties],
        "tokens_per_round_histogram": _histogram([a + 1 for a in accepted]),
        "by_group": _by_group(records),
        "by_context": _by_context(records),
        "by_tree_size": _by_tree_size(records),
        "by_loop": _by_loop(records),
        "time_per_round": _time_per_round(records),
        "batches": _batches(records),
        "per_prompt": records,
    }


def _batch_groups(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The records of each batch that ran together (`batch`: its first prompt's index); unbatched records alone."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(("batch", r["batch"]) if "batch" in r else ("prompt", r["index"]), []).append(r)
    return list(groups.values())


def _batch_rounds(rows: list[dict[str, Any]]) -> list[tuple[int, int, int, float | None]]:
    """The rounds a batch ran: (tree tokens, rows verified, tokens they got, the round's seconds or None). Round k of
    a batch verifies the trees of the rows still decoding, all of one size, in one forward timed once."""
    specs = [r["speculative"] for r in rows]
    out = []
    for k in range(max(len(x["accepted"]) for x in specs)):
        live = [x for x in specs if k < len(x["accepted"])]
        times = live[0].get("round_s") or []
        sizes = live[0].get("tree_nodes") or []
        out.append(
            (
                int(sizes[k]) if k < len(sizes) else 0,
                len(live),
                sum(x["accepted"][k] + 1 for x in live),
                times[k] if k < len(times) else None,
            )
        )
    return out


def _by_tree_size(records: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Rounds pooled by the size of the tree they verified (tree tokens, root included): how many (per row), their
    τ, and their tokens per second (tokens over the rounds' own seconds, drafting to commit; a batch round's tokens
    are all its rows', over its one time; None without round times)."""
    sizes: dict[int, list[tuple[int, int, float | None]]] = {}
    for rows in _batch_groups(records):
        for n, live, tokens, seconds in _batch_rounds(rows):
            sizes.setdefault(n, []).append((live, tokens, seconds))
    out = {}
    for n, rounds in sorted(sizes.items()):
        row_rounds = sum(k for k, _, _ in rounds)
        tokens = sum(t for _, t, _ in rounds)
        timed = all(t is not None for _, _, t in rounds)
        seconds = sum(t for _, _, t in rounds) if timed else 0.0
        out[str(n)] = {
            "rounds": row_rounds,
            "accept_len": tokens / row_rounds,
            "tokens_per_s": tokens / seconds if timed and seconds > 0 else None,
        }
    return out


def _by_loop(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """Rounds that start inside a loop of the output (`in_loop`, `eval.decode.rounds_in_loop`) against the rest: how
    many, their share and τ. A drafter that follows a loop gets them nearly all accepted; None for records without
    the flags."""
    spec = [r["speculative"] for r in records]
    if not spec or any("in_loop" not in x for x in spec):
        return None
    pools: dict[str, list[int]] = {"in_loop": [], "elsewhere": []}
    for x in spec:
        for a, inside in zip(x["accepted"], x["in_loop"]):
            pools["in_loop" if inside else "elsewhere"].append(a)
    total = sum(len(p) for p in pools.values())
    return {
        name: {"rounds": len(p), "share": len(p) / total if total else None, "accept_len": _tau(p)}
        for name, p in pools.items()
    }


def _tau(accepted: list[int]) -> float | None:
    return round_stats(accepted, [False] * len(accepted))["accept_len"]


def _time_per_round(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """Where a speculative round's time goes (seconds per round, pooled; a batch's round counts once, however many
    rows it verified): the verifying target forward, drafting, and the rest of the loop (tree building, acceptance,
    KV commits); with the plain baseline, the time of one plain token for comparison: a round pays off when
    (target + draft + loop) < τ × plain."""
    spec = [r["speculative"] for r in records]
    if not spec or any("target_s" not in x for x in spec):
        return None
    rounds = sum(max(len(r["speculative"]["accepted"]) for r in rows) for rows in _batch_groups(records))
    if not rounds:
        return None
    target, draft, wall = (sum(x[k] for x in spec) / rounds for k in ("target_s", "draft_s", "wall_s"))  # row shares
    out = {"target_s": target, "draft_s": draft, "loop_s": wall - target - draft}
    plain = [r["plain"] for r in records if "plain" in r and r.get("batch_size", 1) == 1]
    if plain:
        out["plain_token_s"] = sum(x["wall_s"] for x in plain) / max(sum(x["new_tokens"] for x in plain), 1)
    return out


def _by_group(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """τ, speed-up and acceptance by depth per prompt group (a prompt record's `category` or `kind`, e.g. MT-bench's
    categories); empty when no prompt names one."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("group") is not None:
            groups.setdefault(str(r["group"]), []).append(r)
    out = {}
    for name, rows in sorted(groups.items()):
        spec = [r["speculative"] for r in rows]
        stats = round_stats([a for x in spec for a in x["accepted"]], [e for x in spec for e in x["extendable"]])
        spec_speed = _speed(rows, "speculative")
        out[name] = {
            "prompts": len(rows),
            **stats,
            "speedup_vs_plain": _ratio(spec_speed, _speed(rows, "plain")),
            "speedup_vs_prompt_lookup": _ratio(spec_speed, _speed(rows, "prompt_lookup")),
        }
    return out


def _by_context(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """τ, acceptance by depth and speed-up per context length asked for (`eval.context_lengths`), with the prompts'
    mean length in tokens; empty without context lengths."""
    lengths: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("context") is not None:
            lengths.setdefault(int(r["context"]), []).append(r)
    out = {}
    for length, rows in sorted(lengths.items()):
        spec = [r["speculative"] for r in rows]
        stats = round_stats([a for x in spec for a in x["accepted"]], [e for x in spec for e in x["extendable"]])
        out[str(length)] = {
            "prompts": len(rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows) / len(rows),
            **stats,
            "speedup_vs_plain": _ratio(_speed(rows, "speculative"), _speed(rows, "plain")),
        }
    return out


def _batches(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many batches of each size ran (rows of a batch of k carry batch_size k; batch size 1 records carry none)."""
    rows = _histogram([r.get("batch_size", 1) for r in records])
    return {k: n // int(k) for k, n in rows.items()}


def _histogram(values: list[int]) -> dict[str, int]:
    return {str(v): values.count(v) for v in sorted(set(values))}


def _fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


def lossless_mark(summary: dict[str, Any]) -> str:
    """A report's lossless cell: ✓ / ✗ where outputs were checked against plain decoding (greedy, or sampled with the
    same coins), "lossy" for Medusa's typical acceptance (it accepts tokens by a threshold, not by the target's
    distribution), n/a without a plain baseline to compare with."""
    if summary.get("acceptance") == "typical":
        return "lossy (typical acceptance)"
    return {True: "✓", False: "✗", None: "n/a"}[summary["lossless"]]


def summary_row(s: dict[str, Any]) -> list[str]:
    """One table row: method, tree, τ, tok/s (plain, spec), speedups, forwards/token, lossless."""
    return [
        s["method"],
        s["tree"],
        _fmt(s["accept_len"]),
        _fmt(s["tokens_per_s"]["plain"], 1),
        _fmt(s["tokens_per_s"]["speculative"], 1),
        _fmt(s["speedup_vs_plain"], 2, "×"),
        _fmt(s["speedup_vs_prompt_lookup"], 2, "×"),
        _fmt(s["forwards_per_token"]),
        lossless_mark(s),
    ]


SUMMARY_HEADER = [
    "method",
    "tree",
    "τ",
    "plain tok/s",
    "spec tok/s",
    "vs plain",
    "vs prompt lookup",
    "fwd/token",
    "lossless",
]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def to_markdown(s: dict[str, Any]) -> str:
    depth_header = ["depth"] + [str(d + 1) for d in range(len(s["accept_rate_by_depth"]))]
    depth_rows = [
        ["accept rate (given reached)"] + [_fmt(x) for x in s["accept_rate_by_depth"]],
        ["rounds reaching it"] + [str(n) for n in s["reached_by_depth"]],
    ]
    prompt_rows = [
        [
            str(r["index"]),
            str(r["speculative"]["new_tokens"]),
            _fmt(round_stats(r["speculative"]["accepted"], r["speculative"]["extendable"])["accept_len"]),
            _fmt(
                _ratio(_speed([r], "speculative"), _speed([r], "plain")) if r.get("batch_size", 1) == 1 else None,
                2,
                "×",
            ),
            lossless_mark({"acceptance": s.get("acceptance"), "lossless": r.get("lossless")}),
        ]
        for r in s["per_prompt"]
    ]
    pl = s["tokens_per_s"]["prompt_lookup"]
    return "\n\n".join(
        [
            f"# Speculative decoding: {s['method']} on {s['target']}",
            f"{s['num_prompts']} prompts from `{s['prompts']}`, max {s['max_new_tokens']} new tokens, "
            f"temperature {s['temperature']}, acceptance `{s['acceptance']}`, kernels `{s['kernels']}`, "
            f"device `{s['device']}`, batch size {s.get('batch_size', 1)}{_batch_note(s)}. "
            f"τ = mean over {s['rounds']} rounds of (accepted + 1). "
            f"Prompt lookup (transformers, no training): {_fmt(pl, 1)} tok/s, "
            f"{_fmt(s['prompt_lookup_vs_plain'], 2, '×')} vs plain."
            + (f" Tree calibrated on {s['tree_calibration']}." if s.get("tree_calibration") else "")
            + _lookup_note(s.get("lookup")),
            *([f"kernels: {s['kernels_backend']}"] if s.get("kernels_backend") else []),
            markdown_table(SUMMARY_HEADER, [summary_row(s)]),
            "## Acceptance by depth\n\n" + markdown_table(depth_header, depth_rows),
            *([_group_table(s["by_group"])] if s.get("by_group") else []),
            *([_context_table(s["by_context"])] if s.get("by_context") else []),
            *([_size_table(s["by_tree_size"])] if len(s.get("by_tree_size") or {}) > 1 else []),
            *([_loop_table(s["by_loop"])] if s.get("by_loop") else []),
            *([_time_table(s["time_per_round"])] if s.get("time_per_round") else []),
            "## Per prompt\n\n" + markdown_table(["prompt", "new tokens", "τ", "speedup", "lossless"], prompt_rows),
        ]
    )


def _lookup_note(lookup: dict[str, Any] | None) -> str:
    """What prompt lookup inside the tree (`eval.lookup_tokens`) contributed."""
    if not lookup:
        return ""
    return (
        f" Prompt lookup in the tree ({lookup['tokens']} tokens, n-gram <= {lookup['ngram']}): verification reached "
        f"{lookup['tried']} lookup tokens and accepted {lookup['accepted']} ({_fmt(lookup['rate'], 2)})."
    )


def _loop_table(loops: dict[str, dict[str, Any]]) -> str:
    names = {
        "in_loop": f"inside a loop (the {REPEAT_NGRAM} tokens before the round occurred earlier)",
        "elsewhere": "elsewhere",
    }
    rows = [[names[k], str(v["rounds"]), _fmt(v["share"], 2), _fmt(v["accept_len"])] for k, v in loops.items()]
    return "## Rounds inside loops of the output\n\n" + markdown_table(["rounds", "count", "share", "τ"], rows)


def _size_table(sizes: dict[str, dict[str, float | None]]) -> str:
    rows = [[n, str(v["rounds"]), _fmt(v["accept_len"]), _fmt(v.get("tokens_per_s"), 1)] for n, v in sizes.items()]
    return "## τ by tree size (rounds that verified a tree of that many tokens)\n\n" + markdown_table(
        ["tree tokens", "rounds", "τ", "tok/s in those rounds"], rows
    )


def _group_table(groups: dict[str, dict[str, Any]]) -> str:
    rows = [
        [
            name,
            str(g["prompts"]),
            _fmt(g["accept_len"]),
            " / ".join(_fmt(x) for x in g["accept_rate_by_depth"][:4]),
            _fmt(g["speedup_vs_plain"], 2, "×"),
            _fmt(g.get("speedup_vs_prompt_lookup"), 2, "×"),
        ]
        for name, g in groups.items()
    ]
    header = ["group", "prompts", "τ", "acceptance by depth", "vs plain", "vs prompt lookup"]
    return "## By prompt group (category / kind)\n\n" + markdown_table(header, rows)


def _context_table(lengths: dict[str, dict[str, Any]]) -> str:
    rows = [
        [
            "prompt alone" if name == "0" else f"≤ {int(name):,}",
            str(c["prompts"]),
            f"{c['prompt_tokens']:,.0f}",
            _fmt(c["accept_len"]),
            " / ".join(_fmt(x) for x in c["accept_rate_by_depth"][:4]),
            _fmt(c["speedup_vs_plain"], 2, "×"),
        ]
        for name, c in lengths.items()
    ]
    header = ["context (tokens)", "prompts", "mean prompt tokens", "τ", "acceptance by depth", "vs plain"]
    return "## τ by context length (each prompt behind earlier conversation)\n\n" + markdown_table(header, rows)


def _time_table(t: dict[str, float]) -> str:
    keys = ["target_s", "draft_s", "loop_s", "plain_token_s"]
    names = {"target_s": "verify (target)", "draft_s": "draft", "loop_s": "loop", "plain_token_s": "one plain token"}
    row = [_fmt(t[k] * 1000, 1) if k in t else "–" for k in keys]
    return "## Time per round (ms)\n\n" + markdown_table([names[k] for k in keys], [row])


def _batch_note(s: dict[str, Any]) -> str:
    """For batched runs: the batches that ran, and what per-prompt figures mean there."""
    if s.get("batch_size", 1) == 1:
        return ""
    ran = ", ".join(f"{n} of {k}" for k, n in sorted(s["batches"].items(), key=lambda kv: -int(kv[0])))
    return (
        f" (batches run: {ran}; speeds are batch throughputs, forwards per token count each row's own rounds, and "
        "a prompt in a batch has no speedup of its own)"
    )


def plot(s: dict[str, Any], path: Path) -> None:
    """Acceptance rate by depth (bars), the histogram of tokens per round (whose mean is τ), τ by tree size when tree
    sizes vary per round, and τ by context length when the run measured several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = s.get("by_tree_size") or {}
    contexts = s.get("by_context") or {}
    panels = 2 + (len(sizes) > 1) + (len(contexts) > 1)
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 3.5))
    ax1, ax2 = axes[0], axes[1]
    rates = [x or 0.0 for x in s["accept_rate_by_depth"]]
    ax1.bar(range(1, len(rates) + 1), rates, color="tab:blue")
    ax1.set_xticks(range(1, len(rates) + 1))
    ax1.set(xlabel="draft depth", ylabel="P(accepted | parent accepted)", ylim=(0, 1), title="acceptance by depth")
    hist = s["tokens_per_round_histogram"]
    ax2.bar([int(k) for k in hist], list(hist.values()), color="tab:green")
    ax2.set_xticks([int(k) for k in hist])
    if s["accept_len"] is not None:
        ax2.axvline(s["accept_len"], color="k", linestyle="--", label=f"τ = {s['accept_len']:.2f}")
        ax2.legend()
    ax2.set(xlabel="tokens per round (accepted + 1)", ylabel="rounds", title="τ histogram")
    if len(sizes) > 1:  # trees whose size changes per round (eval.tree: cost)
        ns = [int(n) for n in sizes]
        rounds = [v["rounds"] for v in sizes.values()]
        axes[2].scatter(ns, [v["accept_len"] for v in sizes.values()], s=[20 + 200 * r / max(rounds) for r in rounds])
        axes[2].set(
            xlabel="tree tokens (point size: rounds)", ylabel="τ of those rounds", title="τ, tok/s by tree size"
        )
        speeds = [v.get("tokens_per_s") for v in sizes.values()]
        if all(x is not None for x in speeds):
            twin = axes[2].twinx()
            twin.plot(ns, speeds, color="tab:red", marker="x", linestyle=":")
            twin.set_ylabel("tok/s in those rounds", color="tab:red")
    if len(contexts) > 1:  # eval.context_lengths: τ against the prompts' mean length
        ax = axes[-1]
        tokens = [c["prompt_tokens"] for c in contexts.values()]
        ax.plot(tokens, [c["accept_len"] for c in contexts.values()], marker="o", color="tab:purple")
        for c, x in zip(contexts.values(), tokens):
            ax.annotate(f"{c['accept_len']:.2f}", (x, c["accept_len"]), textcoords="offset points", xytext=(0, 6))
        ax.set_xscale("log")
        top = max(c["accept_len"] or 0 for c in contexts.values())
        ax.set(xlabel="prompt tokens (mean, log scale)", ylabel="τ", ylim=(0, top * 1.2 + 0.1), title="τ by context")
    fig.suptitle(f"{s['method']} ({s['tree']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(summary: dict[str, Any], out_dir: str | Path) -> Path:
    """Write report.json, report.md and report.png to `out_dir`; returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / "report.md").write_text(to_markdown(summary) + "\n")
    plot(summary, out / "report.png")
    return out
