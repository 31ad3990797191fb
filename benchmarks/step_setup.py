"""A recipe's drafter and batches, built as its training builds them, for the benchmarks that time a training step
(`benchmarks.target_stats`, `benchmarks.keep_freed_memory`).

The draft vocabulary is picked here by the training loop's rule (the training split's most frequent loss tokens),
never through the loop's own helper: that records it in the recipe's run directory, which may hold a running run.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator

from data import target_stats
from data.loader import BatchLoader
from data.shards import FeatureDataset
from data.vocab_counts import frequent_loss_tokens
from methods import METHODS
from schema.recipe import Recipe
from train import loop


def drafter_on_features(recipe: Recipe, accelerator: Accelerator) -> tuple[torch.nn.Module, FeatureDataset, str]:
    """(the drafter in training mode, its feature set, the line saying whether the set's target statistics are
    attached). Statistics are attached where the method reads them and the set has them stored."""
    target = loop.build_target(recipe, accelerator)
    dataset = FeatureDataset(recipe.data.features_dir, verify_checksums=False)
    method = METHODS[recipe.drafter.method]
    line = f"{recipe.drafter.method} reads no target statistics"
    if method.target_statistics:
        line = target_stats.attach(dataset, target.lm_head)
    drafter = method.module()(recipe.drafter, target.parts(recipe.data.layers))
    if method.own_vocab:
        drafter.set_draft_vocab(frequent_loss_tokens(dataset, recipe.drafter.draft_vocab, []), init_head=True)
    drafter.train()
    return drafter, dataset, line


def first_batches(recipe: Recipe, dataset: FeatureDataset, count: int) -> list[dict]:
    """The first `count` batches of epoch 0, as the recipe's training loader makes them."""
    cfg = recipe.train
    loader = BatchLoader(dataset, batch_size=cfg.batch_size, packing=cfg.packing, max_len=recipe.data.max_len,
                         seed=cfg.seed, read_ahead=False)  # fmt: skip
    epoch = iter(loader.epoch(0))
    return [next(epoch) for _ in range(count)]
