"""How often each token is a loss token in a feature set or a prepared dataset: what a draft vocabulary
(`drafter.draft_vocab`, `train.loss_vocab`, `eval.draft_vocab`) is chosen from, the most frequent first.

    python -m data.vocab_counts RECIPE [key=value ...] [--sizes 8000 16000] [--reports EVAL_DIR ...]

prints how much of the answers a draft vocabulary of each size covers, chosen as training chooses it (the most
frequent loss tokens of the training split): the training answers, the held-out answers, and the target's outputs
in evaluation reports (re-tokenized from their text). A drafter can never propose a token outside its vocabulary,
so the held-out and evaluation coverages cap the acceptance at every depth. The sizes: the recipe's
`drafter.draft_vocab`, those covering 95 / 98 / 99 / 99.5% of the training answers, and any `--sizes`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Collection, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from data.shards import FeatureDataset


def loss_token_counts(
    dataset: FeatureDataset | Sequence[dict], vocab_size: int | None = None, skip_ids: Collection[int | str] = ()
) -> torch.Tensor:
    """How often each token id is a loss token in a feature dataset's shards (or in token samples with `input_ids`
    and `loss_mask`), leaving out the samples whose id is in `skip_ids` (a run's held-out samples): (vocab_size,)
    int64, or as long as the largest id seen + 1 when `vocab_size` is None; ids >= vocab_size are refused."""
    skip = set(skip_ids)
    if isinstance(dataset, FeatureDataset):
        where = str(dataset.directory)

        def loss_ids():
            for entry in dataset.shards:
                with safe_open(str(dataset.directory / entry["file"]), framework="pt") as shard:
                    scored = shard.get_tensor("loss_mask") > 0
                    if skip and not skip.isdisjoint(entry["sample_ids"]):
                        kept = torch.tensor([i not in skip for i in entry["sample_ids"]])
                        scored &= kept.repeat_interleave(torch.tensor(entry["lengths"]))
                    yield shard.get_tensor("input_ids").to(torch.int64)[scored]
    else:
        where = "the token samples"

        def loss_ids():
            for s in dataset:
                if s.get("id") not in skip:
                    yield torch.as_tensor(s["input_ids"]).to(torch.int64)[torch.as_tensor(s["loss_mask"]) > 0]

    counts = torch.zeros(vocab_size or 0, dtype=torch.int64)
    for ids in loss_ids():
        if vocab_size is not None and len(ids) and int(ids.max()) >= vocab_size:
            raise ValueError(f"vocab_size={vocab_size}: {where} has loss token id {int(ids.max())}")
        new = torch.bincount(ids)
        if len(new) > len(counts):
            counts = torch.nn.functional.pad(counts, (0, len(new) - len(counts)))
        counts[: len(new)] += new
    return counts


def frequent_loss_tokens(
    dataset: FeatureDataset | Sequence[dict], size: int, skip_ids: Collection[int | str] = ()
) -> torch.Tensor:
    """The `size` most frequent loss tokens of a feature dataset's shards (or of token samples with `input_ids` and
    `loss_mask`, as online training reads them), the samples with ids in `skip_ids` left out, most frequent first
    (ties: lower id first): (<= size,) int64. Training's `train.loss_vocab` and `drafter.draft_vocab` and
    evaluation's `eval.draft_vocab` all use it, leaving out the run's held-out samples, so the same size gives the
    same tokens."""
    return most_frequent(loss_token_counts(dataset, skip_ids=skip_ids), size)


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of `counts` (`loss_token_counts`), most frequent first (ties: lower id
    first), never one that was not seen: (<= size,) int64."""
    seen = int((counts > 0).sum())
    return counts.argsort(descending=True, stable=True)[: min(size, seen)]


def coverage_size(counts: torch.Tensor, coverage: float) -> int:
    """The fewest most-frequent tokens whose counts (`loss_token_counts`) reach `coverage` of all."""
    ordered = torch.sort(counts, descending=True).values
    total = int(ordered.sum())
    if total == 0:
        return 0
    covered = torch.cumsum(ordered, 0)
    return int(torch.searchsorted(covered, torch.tensor(math.ceil(coverage * total)))) + 1


def coverage(counts: torch.Tensor, vocab: torch.Tensor) -> float:
    """The share of the tokens counted in `counts` that are in `vocab` (ids)."""
    total = int(counts.sum())
    inside = vocab[vocab < len(counts)]
    return float(counts[inside].sum()) / total if total else float("nan")


def report_output_counts(directory: Path, tokenizer, vocab_size: int) -> torch.Tensor:
    """Token counts of the outputs of an evaluation report (`DIR/report.json`, its `per_prompt` outputs), re-tokenized
    from their text with the target's tokenizer (reports keep the text, not the ids: a tokenizer that does not
    round-trip its own output exactly makes this an approximation)."""
    path = directory / "report.json"
    try:
        rows = json.loads(path.read_text())["per_prompt"]
        texts = [row["output"] for row in rows]
        if not all(isinstance(text, str) for text in texts):
            raise TypeError("an output that is not text")
    except FileNotFoundError:
        raise ValueError(f"{path}: no report (run the evaluation first)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not an evaluation report with outputs ({exc.__class__.__name__}: {exc})") from None
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    return counts


COVERAGES = (0.95, 0.98, 0.99, 0.995)


def main(argv: list[str] | None = None) -> None:
    from data.extract import data_identity
    from data.prepare import prepare_dataset
    from data.shards import split_by_id
    from methods import METHODS
    from models.target import load_tokenizer
    from schema.recipe import load_recipe

    parser = argparse.ArgumentParser(prog="python -m data.vocab_counts", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--sizes", nargs="+", type=int, default=[], help="more draft vocabulary sizes to show")
    parser.add_argument("--reports", nargs="+", type=Path, default=[], help="evaluation output directories")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides, inputs=("target.path", "target.tokenizer"))
    data, cfg = recipe.data, recipe.train
    tokenizer = load_tokenizer(recipe.target.path, recipe.target.tokenizer, recipe.target.trust_remote_code)
    vocab_size = len(tokenizer)
    short = ["/".join(d.parts[-2:]) for d in args.reports]  # names unless two reports share them
    names = short if len(set(short)) == len(short) else [str(d) for d in args.reports]
    reports = {name: report_output_counts(d, tokenizer, vocab_size) for name, d in zip(names, args.reports)}
    features = None if cfg.online or data.features_dir is None else Path(data.features_dir)
    if features is not None and (features / "manifest.json").exists():  # refused, as training refuses, when stale
        expect = data_identity(data, tokenizer)
        samples: FeatureDataset | Sequence[dict] = FeatureDataset(features, verify_checksums=False, expect=expect)
        ids, source = list(samples.sample_ids), str(features)
    else:
        samples = prepare_dataset(data, tokenizer).samples
        ids, source = [s["id"] for s in samples], "the recipe's data files (tokenized)"
    train_idx, heldout_idx = split_by_id(ids, data.heldout_fraction, cfg.seed)
    if cfg.first_records is not None:  # as training reads them: sample ids are record numbers
        train_idx = [i for i in train_idx if int(ids[i]) < cfg.first_records]
        if not train_idx:
            raise ValueError(f"{recipe.source}: train.first_records: no training sample among the first "
                             f"{cfg.first_records} records")  # fmt: skip
    trained = {ids[i] for i in train_idx}
    counts = loss_token_counts(samples, vocab_size, skip_ids=set(ids) - trained)
    heldout = loss_token_counts(samples, vocab_size, skip_ids=set(ids) - {ids[i] for i in heldout_idx})
    own = METHODS[recipe.drafter.method].own_vocab  # a drafter with its own vocabulary has a drafter.draft_vocab
    sizes = {recipe.drafter.draft_vocab: "the recipe's"} if own else {}
    for share in COVERAGES:
        sizes.setdefault(coverage_size(counts, share), f"{share:.1%} of the training answers")
    for size in args.sizes:
        sizes.setdefault(size, "")
    distinct = int((counts > 0).sum())
    print(f"{source}: {len(train_idx):,} training samples ({int(counts.sum()):,} loss tokens, {distinct:,} distinct), "
          f"{len(heldout_idx):,} held out ({int(heldout.sum()):,})")  # fmt: skip
    head = ["draft tokens", "sized by", "training answers", "held-out answers", *(f"outputs: {r}" for r in reports)]
    print("| " + " | ".join(head) + " |\n|---:|---|" + "---:|" * (len(head) - 2))
    for size in sorted(sizes):
        vocab, note = most_frequent(counts, size), sizes[size]
        if size > distinct:  # training refuses it
            note = "; ".join(filter(None, [note, f"more than the {distinct:,} distinct tokens"]))
        shares = [coverage(c, vocab) for c in (counts, heldout, *reports.values())]
        print("| " + " | ".join([f"{size:,}", note, *("–" if math.isnan(x) else f"{x:.2%}" for x in shares)]) + " |")


if __name__ == "__main__":
    import sys

    from models.target import TargetError
    from schema.recipe import RecipeError

    try:
        main()
    except (RecipeError, TargetError, ValueError) as exc:
        sys.exit(f"error: {exc}")
