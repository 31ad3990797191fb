"""How often each token is a loss token in a feature set or a prepared dataset: what a draft vocabulary
(`drafter.draft_vocab`, `train.loss_vocab`, `eval.draft_vocab`) is chosen from, the most frequent first."""

from __future__ import annotations

from collections.abc import Collection, Sequence

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
