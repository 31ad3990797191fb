"""Medusa-2 against Medusa-1 on the pocket target with the same training tokens: the README's Medusa-2 table.

    python recipes/pocket/medusa2_compare.py [--demo artifacts/demo] [--out artifacts/medusa2-compare] [--steps 120]

Two arms on the demo's self-distilled data (run `make demo-pocket` first), batch 8 as the recipes:
  - Medusa-1: `recipes/pocket/medusa1.yaml` for STEPS steps (frozen target);
  - Medusa-1 for STEPS/2 steps, then Medusa-2 (`recipes/pocket/medusa2.yaml`: heads + LoRA, self-distilled KL) from
    those heads for STEPS/2 steps, exported with the LoRA merged (Medusa-2 is evaluated on, and ships with, the
    merged target).
Reported per arm: the heads' held-out top-1 accuracy (the run's last eval), τ on a 3-deep chain and on a calibrated
5-node tree (20 held-out prompts, greedy, lossless check), and the language-model loss of the (adapted) target on
the 100 held-out prompt texts, which shows whether the backbone drifted. Steps are subprocesses with logs under
OUT/logs/, skipped when complete.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]

from eval.report import lossless_mark, markdown_table  # noqa: E402
from recipes.pocket.demo import RECIPES, banner, clear_report, followup_parser, followup_setup, run_step, skip  # noqa: E402

MEDUSA2_RECIPE = "recipes/pocket/medusa2.yaml"
HELDOUT_PROMPTS = ROOT / "recipes" / "pocket" / "prompts" / "heldout.jsonl"
TREES = {"chain-3": ["eval.tree=chain", "eval.tree_depth=3"], "calibrated-5": ["eval.tree=calibrated"]}


@torch.no_grad()
def heldout_lm_loss(model_dir: Path, tokenizer_dir: Path) -> float:
    """Token-weighted next-token loss (fp32) of an HF model over the held-out prompt texts, each `<|bos|> text`."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for line in HELDOUT_PROMPTS.read_text().splitlines():
        ids = torch.tensor([tok(json.loads(line)["prompt"])["input_ids"]])  # (1, T), <|bos|> first
        logits = model(input_ids=ids).logits[0, :-1]  # (T-1, V)
        total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return total / count


def last_eval_accuracy(run_dir: Path, heads: int) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in rows if "eval/acc@1/head1" in r][-1]
    return [last[f"eval/acc@1/head{k}"] for k in range(1, heads + 1)]


def main() -> None:
    parser = followup_parser(__doc__.split("\n\n")[0], "artifacts/medusa2-compare")
    parser.add_argument("--steps", type=int, default=120, help="training steps per arm (Medusa-2 arm: half + half)")
    parser.add_argument("--target", default="recipes/pocket/target")
    args = parser.parse_args()
    demo, out, half = Path(args.demo), Path(args.out), args.steps // 2
    needed = [demo / "selfdistill.jsonl", demo / "features" / "manifest.json"]
    env, log_dir = followup_setup("medusa2_compare", args, needed)
    py, start = sys.executable, time.perf_counter()
    data = [f"data.train_files=[{demo}/selfdistill.jsonl]", f"data.features_dir={demo}/features"]

    runs = {  # name -> (recipe, overrides)
        "medusa1-full": (RECIPES["medusa1"], [f"train.max_steps={args.steps}"]),
        "medusa1-half": (RECIPES["medusa1"], [f"train.max_steps={half}"]),
        "medusa2": (MEDUSA2_RECIPE, [f"train.max_steps={half}", f"drafter.stage1_heads={out}/medusa1-half/export"]),
    }
    for name, (recipe, extra) in runs.items():
        banner(f"train + export {name} ({recipe} {' '.join(extra)})")
        run_dir = out / name
        if (ROOT / run_dir / "export" / "config.json").is_file():
            skip(f"{run_dir}/export")
            continue
        inputs = data if recipe != MEDUSA2_RECIPE else data[:1]  # Medusa-2 trains online (no feature shards)
        overrides = [*inputs, *extra, f"train.output_dir={run_dir}", "train.resume=auto"]
        run_step(f"train-{name}", [py, "-m", "train", recipe, *overrides], log_dir, env)
        run_step(f"export-{name}", [py, "-m", "export", str(run_dir)], log_dir, env)

    arms = {"medusa1-full": f"Medusa-1, {args.steps} steps", "medusa2": f"Medusa-1 {half} → Medusa-2 {half}"}
    taus: dict[tuple[str, str], dict] = {}
    for name in arms:
        recipe = runs[name][0]
        for tree, tree_overrides in TREES.items():
            banner(f"eval {name} on {tree}")
            report = ROOT / out / name / f"eval-{tree}" / "report.json"
            export_time = (ROOT / out / name / "export" / "config.json").stat().st_mtime
            if report.is_file() and report.stat().st_mtime > export_time:
                skip(f"{out}/{name}/eval-{tree}/report.json")
            else:
                overrides = [f"eval.drafter={out}/{name}/export", f"eval.output_dir={out}/{name}/eval-{tree}"]
                overrides += [*tree_overrides, "eval.tree_total_tokens=6", f"eval.max_prompts={args.prompts}"]
                overrides += ["eval.draft_vocab=0"]  # both arms draft over the whole vocabulary
                clear_report(report.parent)
                run_step(f"eval-{name}-{tree}", [py, "-m", "eval", recipe, *overrides], log_dir, env)
            taus[name, tree] = json.loads(report.read_text())

    banner("held-out language-model loss (100 held-out prompt texts)")
    torch.set_num_threads(args.threads)
    target_loss = heldout_lm_loss(ROOT / args.target, ROOT / args.target)
    merged_loss = heldout_lm_loss(ROOT / out / "medusa2" / "export" / "merged", ROOT / args.target)

    rows = [["pocket target", "–", "–", "–", f"{target_loss:.4f}"]]
    for name, label in arms.items():
        acc = " / ".join(f"{a:.3f}" for a in last_eval_accuracy(ROOT / out / name, 3))
        cells = []
        for tree in TREES:
            r = taus[name, tree]
            cells.append(f"{r['accept_len']:.3f} ({r['tree']}) {lossless_mark(r)}")
        loss = f"{target_loss:.4f} (frozen)" if name == "medusa1-full" else f"{merged_loss:.4f}"
        rows.append([label, acc, *cells, loss])
    header = ["run", "head acc@1 (heads 1-3)", "τ chain-3", "τ calibrated 5 nodes", "held-out LM loss"]
    banner(f"Medusa-2 vs Medusa-1 on the pocket target ({args.steps} steps × batch 8 each)")
    print(markdown_table(header, rows))
    print(f"\nTotal {time.perf_counter() - start:.0f}s.")


if __name__ == "__main__":
    main()
