"""Why EAGLE's first draft is accepted less often than its held-out accuracy says, after `make demo-pocket`.

    python recipes/pocket/acceptance_gap.py [--demo artifacts/demo]

Measures the drafter's teacher-forced top-1 accuracy (target features in, first draft step out) on one set of
positions after another, from the training metric down to the rounds of the demo's evaluation:
  1. the metric as training logs it (`eval/acc@1`, against the target's argmax), on the held-out batches the run
     evaluates (`train.eval_batches` × `train.batch_size` samples), then on the whole held-out split;
  2. against the data's next token on the held-out split, by position in the response;
  3. on the greedy continuations of the demo's held-out eval prompts: every position, then only the positions where
     a verification round started (from the eval report's accepted lengths), split by how the previous round ended.
The last figure should match the report's depth-1 acceptance (the demo drafts over a 1024-token vocabulary, these
figures over the whole one). In-process, about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from data.shards import FeatureDataset  # noqa: E402
from eval.baselines import plain_generate  # noqa: E402
from eval.calibration import heldout_positions  # noqa: E402
from eval.decode import DecodeSettings  # noqa: E402
from eval.prompts import load_prompts, stop_token_ids  # noqa: E402
from models.io import load_drafter  # noqa: E402
from models.target import load_target  # noqa: E402
from schema.recipe import load_recipe  # noqa: E402
from train.loop import evaluated_heldout  # noqa: E402


class Rate:
    def __init__(self) -> None:
        self.hits, self.n = 0, 0

    def add(self, hit: bool) -> None:
        self.hits, self.n = self.hits + int(hit), self.n + 1

    def __str__(self) -> str:
        return f"{self.hits / max(self.n, 1):.3f} ({self.n} positions)"


def first_draft_predictions(drafter, feats: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced first draft step over a whole sequence: (T-1,) argmax, entry p predicts token p + 2."""
    T = ids.shape[1]
    logits, _ = drafter.step(feats[:, : T - 1], ids[:, 1:T], torch.arange(T - 1)[None], drafter.new_cache())
    return logits[0].argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", default="artifacts/demo", help="output of a finished `make demo-pocket`")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    demo = ROOT / args.demo
    run = demo / "eagle2"
    for path in (run / "export" / "config.json", run / "eval" / "report.json", demo / "features" / "manifest.json"):
        if not path.is_file():
            sys.exit(f"acceptance_gap: {path} is missing: run `make demo-pocket` first (or pass --demo)")
    torch.set_num_threads(args.threads)
    recipe = load_recipe(run / "recipe.yaml")
    target = load_target(**{**vars(recipe.target), "dtype": "float32"})
    drafter = load_drafter(run / "export", target)
    report = json.loads((run / "eval" / "report.json").read_text())

    dataset = FeatureDataset(demo / "features")
    _, heldout = heldout_positions(recipe, dataset.sample_ids, str(demo / "features"))  # the run's recorded split
    cap = recipe.train.eval_batches * recipe.train.batch_size
    scored = set(evaluated_heldout(list(heldout), cap, recipe.train.seed))  # the samples behind the logged eval/acc@1
    logged = len(scored)
    metric_logged, metric_all, data_all = Rate(), Rate(), Rate()
    by_offset: dict[int, Rate] = {}
    with torch.inference_mode():
        for i in heldout:
            sample = dataset[i]
            ids, mask, feats = sample["input_ids"][None], sample["loss_mask"], sample["hidden"][None].float()
            pred = first_draft_predictions(drafter, feats, ids)
            argmax = drafter.logits(feats[0, :, dataset.layers.index(-1)]).argmax(-1)  # entry q predicts token q + 1
            first = int(torch.nonzero(mask)[0])
            for p in range(ids.shape[1] - 1):
                if mask[p + 1] > 0:  # the training metric: x_{p+1} is a loss token, compared with the target argmax
                    hit = bool(pred[p] == argmax[p + 1])
                    metric_all.add(hit)
                    if i in scored:
                        metric_logged.add(hit)
                if p + 2 < ids.shape[1] and mask[p + 2] > 0:
                    hit = bool(pred[p] == ids[0, p + 2])
                    data_all.add(hit)
                    by_offset.setdefault(min((p + 2 - first) // 16, 5), Rate()).add(hit)

        prompts = load_prompts(recipe.eval.prompts, target.tokenizer, recipe.eval.max_prompts)
        settings = DecodeSettings(max_new_tokens=recipe.eval.max_new_tokens, eos_token_ids=stop_token_ids(target))
        depth = max(max(r["speculative"]["tree_depth"]) for r in report["per_prompt"])
        every, starts = Rate(), Rate()
        after = {"the first round": Rate(), "after a rejection": Rate(), "after a fully accepted tree": Rate()}
        for prompt, record in zip(prompts, report["per_prompt"]):
            ids = torch.tensor([prompt["input_ids"]])
            full = torch.cat([ids, torch.tensor([plain_generate(target.model, ids, settings).tokens])], 1)
            feats = target.hidden_states(full, layers=drafter.cfg.feature_layers)
            pred = first_draft_predictions(drafter, feats, full)
            L, T = ids.shape[1], full.shape[1]
            right = {p: bool(pred[p] == full[0, p + 2]) for p in range(L - 1, T - 2)}
            for hit in right.values():
                every.add(hit)
            root, previous = L, None  # a round's root stands at `root`; its first draft is predicted at root - 1
            for accepted in record["speculative"]["accepted"]:
                if root - 1 in right:
                    starts.add(right[root - 1])
                    key = "the first round" if previous is None else (
                        "after a fully accepted tree" if previous == depth else "after a rejection"
                    )  # fmt: skip
                    after[key].add(right[root - 1])
                previous, root = accepted, root + accepted + 1

    print(f"EAGLE-2 drafter of {run}: teacher-forced top-1 accuracy of the first draft step")
    print(f"1. training metric, the {logged} held-out samples the run evaluates: {metric_logged}")
    print(f"   training metric, all {len(heldout)} held-out samples:               {metric_all}")
    print(f"2. against the data's next token, all held-out samples:         {data_all}")
    for k in sorted(by_offset):
        print(f"   response tokens {16 * k}-{16 * k + 15}{'+' if k == 5 else ''}: {by_offset[k]}")
    print(f"3. greedy continuations of {len(prompts)} held-out eval prompts, every position: {every}")
    print(f"   positions where a verification round started:              {starts}")
    for key, rate in after.items():
        print(f"     {key}: {rate}")
    print(f"   the eval report's depth-1 acceptance: {report['accept_rate_by_depth'][0]:.3f} ({report['tree']})")


if __name__ == "__main__":
    main()
