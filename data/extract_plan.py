"""How an extraction cuts its work before running the target: samples into shards of about `data.shard_tokens`
(sorted by length, so the plan never depends on the number of processes), the plan's fingerprint a resumed run must
match, forwards of at most `data.extract_batch_tokens` padded tokens, and the samples a pca basis is fitted on."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from data.prepare import TokenSample

if TYPE_CHECKING:  # schema.recipe pulls in every drafter; extraction needs none of them
    pass


def plan_shards(samples: list[TokenSample], shard_tokens: int) -> list[list[int]]:
    """Positions into `samples` per shard: sorted by (length, id), cut at the first boundary >= shard_tokens."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i]["input_ids"]), samples[i]["id"]))
    plan: list[list[int]] = [[]]
    tokens = 0
    for i in order:
        plan[-1].append(i)
        tokens += len(samples[i]["input_ids"])
        if tokens >= shard_tokens:
            plan.append([])
            tokens = 0
    return [shard for shard in plan if shard]


def plan_sha256(samples: list[TokenSample], plan: list[list[int]]) -> str:
    """Fingerprint of the plan and the token data: a resumed run must extract exactly the same thing."""
    digest = hashlib.sha256()
    for shard in plan:
        for i in shard:
            s = samples[i]
            digest.update(np.array([s["id"], len(s["input_ids"])], dtype=np.int64).tobytes())
            digest.update(np.array(s["input_ids"], dtype=np.int64).tobytes())
            digest.update(np.array(s["loss_mask"], dtype=np.uint8).tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]


def length_batches(lengths: list[int], batch_tokens: int) -> list[tuple[int, int]]:
    """[start, end) batches over ascending `lengths`, each padded to its longest sample within batch_tokens."""
    batches, start = [], 0
    for i in range(len(lengths)):
        if i > start and (i - start + 1) * lengths[i] > batch_tokens:
            batches.append((start, i))
            start = i
    batches.append((start, len(lengths)))
    return batches


def fit_positions(samples: list[TokenSample], plan: list[list[int]], fit_tokens: int) -> list[int]:
    """Positions into `samples` that a pca basis is fitted on: every k-th sample of the plan's (length-sorted) order,
    k chosen so that they hold about `fit_tokens` tokens (all samples when the data holds fewer)."""
    order = [i for shard in plan for i in shard]
    total = sum(len(samples[i]["input_ids"]) for i in order)
    every = max(1, total // max(fit_tokens, 1))
    return order[::every]
