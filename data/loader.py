"""Batches for the training loop from feature shards or token samples, per process, resumable.

    loader = BatchLoader(FeatureDataset(dir), train_idx, batch_size=8, accum=2, rank=r, world_size=n, seed=0)
    batches = loader.batches()          # endless; epochs advance with a new shuffle
    state = loader.state_dict()         # {"epoch", "rows"}: rows of the epoch consumed by all processes

Every epoch is planned up front from the sample lengths alone: a shuffle seeded by (seed, epoch),
then rows (one sample per row, or with `packing` samples concatenated up to `max_len` tokens with
position ids restarting at 0 per sample). Rows are wrapped around to a multiple of the global step
(batch_size x accum x world_size rows) and taken in order: micro-batch m of the epoch is rows
[m·B·N, (m+1)·B·N), dealt round-robin to the N processes. Every process gets the same number of
full batches (DDP ranks stay in step), and the position is counted in rows, so a state saved by N
processes restores on M with the same global step (batch_size x accum x world_size) and replays
exactly the same rows per optimizer step. With `score_fill=False` (held-out evaluation) the rows
repeated to fill the last step carry no loss tokens, so every sample counts once.

Batches are `DraftBatch` dicts, right-padded to the batch's longest row: attention_mask 0 and
loss_mask 0 on padding, and padding positions continue the last sample's positions (so they never
look like the start of a new packed sample). Feature batches carry `hidden` (B, T, n_layers, d) in
the storage dtype; the loop casts. An encoded feature set (`data.codecs`: fp8_e4m3, pca) is collated as stored and
decoded a batch at a time on `device` (the training device: the codes cross to it, not the float32 states), to
float32, zero on padding like a plain batch. Over feature sets the loader reads the next batch from the shards on a
thread while the caller decodes and trains on this one (`read_ahead`), so reading a set larger than memory from
the disk overlaps the work; batches and states are those of reading in turn.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from data.prepare import TokenSample
from data.shards import FeatureDataset
from data.target_stats import KEYS as STAT_KEYS
from models.common import DraftBatch


def _sample(position: int) -> int:
    """The sample a plan position names: i, or i for ~i (a repeat of i that carries no loss tokens)."""
    return position if position >= 0 else ~position


class BatchLoader:
    """Deterministic, rank-sharded, resumable batches over `samples[indices]` (see module docstring)."""

    def __init__(
        self,
        samples: FeatureDataset | Sequence[TokenSample],
        indices: Sequence[int] | None = None,
        *,
        batch_size: int,
        accum: int = 1,
        packing: bool = False,
        max_len: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        score_fill: bool = True,
        device: torch.device | str | None = None,
        read_ahead: bool = True,
    ) -> None:
        if packing and max_len is None:
            raise ValueError("BatchLoader: packing needs max_len")
        if not 0 <= rank < world_size:
            raise ValueError(f"BatchLoader: rank {rank} not in [0, {world_size})")
        self.samples = samples
        self.indices = list(range(len(samples)) if indices is None else indices)
        if not self.indices:
            raise ValueError("BatchLoader: no samples")
        self.batch_size, self.accum, self.packing, self.max_len = batch_size, accum, packing, max_len
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.score_fill = score_fill  # False: rows repeated to fill the last step carry no loss tokens
        self.features = isinstance(samples, FeatureDataset)
        self.encoded = self.features and samples.codec.encoded  # decoded per batch, on `device`
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.read_ahead = read_ahead and self.features  # token samples are in memory: nothing to wait for
        raw = samples.lengths if self.features else [len(s["input_ids"]) for s in samples]
        self.lengths = {i: min(raw[i], max_len or raw[i]) for i in self.indices}
        self._epoch, self._batch = 0, 0
        self._plan_cache: tuple[int, list[list[list[int]]]] | None = None

    @property
    def statistics(self) -> tuple[str, ...]:
        """The batch keys of the target's stored statistics (`data.target_stats`), when the feature set has them."""
        return STAT_KEYS if self.features and self.samples.statistics is not None else ()

    # ---------------------------------------------------------------------------------- planning

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """This process's batches for `epoch`: batches of rows of sample positions."""
        if self._plan_cache is not None and self._plan_cache[0] == epoch:
            return self._plan_cache[1]
        order = list(self.indices)
        if self.shuffle:
            order = [order[j] for j in np.random.default_rng([self.seed, epoch]).permutation(len(order))]
        rows = self._pack(order) if self.packing else [[i] for i in order]
        step = self.step_rows
        total = -(-len(rows) // step) * step
        fill = (rows * (total // len(rows) + 1))[len(rows) : total]  # every step full: repeat rows from the start
        rows = rows + (fill if self.score_fill else [[~i for i in row] for row in fill])  # ~i: i, not scored
        mine = rows[self.rank :: self.world_size]
        plan = [mine[b : b + self.batch_size] for b in range(0, len(mine), self.batch_size)]
        self._plan_cache = (epoch, plan)
        return plan

    def _pack(self, order: list[int]) -> list[list[int]]:
        """Next-fit packing in shuffled order: a row closes when the next sample would overflow max_len."""
        rows: list[list[int]] = [[]]
        used = 0
        for i in order:
            if rows[-1] and used + self.lengths[i] > self.max_len:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += self.lengths[i]
        return rows

    def __len__(self) -> int:
        """Batches per epoch for this process (the same for every process)."""
        return len(self.plan(self._epoch))

    # ---------------------------------------------------------------------------------- iteration

    def epoch(self, epoch: int) -> Iterator[DraftBatch]:
        """The batches of one epoch, from the first; does not touch the resume state."""
        for _, batch in self._read_ahead(enumerate(self.plan(epoch))):
            yield batch

    def batches(self) -> Iterator[DraftBatch]:
        """Endless batches from the current state; the state always names the next batch (the one read ahead
        counts only once it is handed out)."""

        def planned() -> Iterator[tuple[tuple[int, int], list[list[int]]]]:
            epoch, start = self._epoch, self._batch
            while True:
                for b, rows in enumerate(self.plan(epoch)[start:], start):
                    yield (epoch, b), rows
                epoch, start = epoch + 1, 0

        for (epoch, b), batch in self._read_ahead(planned()):
            self._epoch, self._batch = epoch, b + 1
            yield batch

    def _read_ahead(self, plan: Iterator[tuple[Any, list[list[int]]]]) -> Iterator[tuple[Any, DraftBatch]]:
        """(key, collated batch) for each (key, rows) of `plan`, the next one read from the shards on a thread while
        the caller works on this one (with `read_ahead`): reading (page faults on a set larger than memory) overlaps
        decoding and training."""
        if not self.read_ahead:
            for key, rows in plan:
                yield key, self.collate(rows)
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead") as pool:
            pending = None
            for key, rows in plan:
                future = key, pool.submit(self.stage, rows)
                if pending is not None:
                    yield pending[0], self.finish(pending[1].result())
                pending = future
            if pending is not None:
                yield pending[0], self.finish(pending[1].result())

    @property
    def step_rows(self) -> int:
        """Rows of one optimizer step over all processes."""
        return self.batch_size * self.accum * self.world_size

    def state_dict(self) -> dict[str, int]:
        """Where the next batch comes from, independent of how many processes read: (epoch, rows consumed)."""
        return {"epoch": self._epoch, "rows": self._batch * self.batch_size * self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position; the rows consumed must fall on a micro-batch of this loader's processes."""
        rows, per_batch = int(state["rows"]), self.batch_size * self.world_size
        if rows % per_batch:
            raise ValueError(
                f"data position {rows} rows into epoch {state['epoch']} is not a whole number of batches of "
                f"{self.batch_size} x {self.world_size} processes: keep batch_size x grad_accum x processes the same"
            )
        self._epoch, self._batch = int(state["epoch"]), rows // per_batch

    # ---------------------------------------------------------------------------------- collation

    def _item(self, i: int) -> dict[str, Any]:
        n = self.lengths[i]
        if self.encoded:
            item = self.samples.encoded(i)
            return {**{k: item[k][:n] for k in ("input_ids", "loss_mask", *self.statistics)},
                    **{f"parts.{k}": v[:n] for k, v in item["parts"].items()}}  # fmt: skip
        if self.features:
            item = self.samples[i]
            return {k: item[k][:n] for k in ("input_ids", "loss_mask", "hidden", *self.statistics)}
        s = self.samples[i]
        return {
            "input_ids": torch.tensor(s["input_ids"][:n], dtype=torch.int64),
            "loss_mask": torch.tensor(s["loss_mask"][:n], dtype=torch.float32),
        }

    def collate(self, rows: list[list[int]]) -> DraftBatch:
        """Right-padded (B, T) batch of rows; a row holds one sample, or several when packing (a position ~i: sample
        i with no loss tokens, a repeat that fills the last step of an unscored fill)."""
        return self.finish(self.stage(rows))

    def stage(self, rows: list[list[int]]) -> DraftBatch:
        """The batch as read: an encoded set's stored tensors under `parts.<name>`, not decoded yet (`finish`)."""
        B = len(rows)
        T = max(sum(self.lengths[_sample(i)] for i in row) for row in rows)
        batch: DraftBatch = {
            "input_ids": torch.zeros(B, T, dtype=torch.int64),
            "loss_mask": torch.zeros(B, T, dtype=torch.float32),
            "attention_mask": torch.zeros(B, T, dtype=torch.int64),
            "position_ids": torch.zeros(B, T, dtype=torch.int64),
        }
        ds = self.samples
        if self.encoded:  # the stored tensors, decoded below
            staged = {f"parts.{k}": torch.zeros(B, T, *shape, dtype=dtype) for k, (shape, dtype) in
                      ds.codec.part_shapes().items()}  # fmt: skip
            batch.update(staged)
        elif self.features:
            batch["hidden"] = torch.zeros(B, T, len(ds.layers), ds.hidden_size, dtype=ds.dtype)  # (B, T, n, d)
        if self.statistics:  # the target's stored top-1 and logsumexp (data.target_stats); -1 / NaN on padding
            batch["target_top1"] = torch.full((B, T), -1, dtype=torch.int64)
            batch["target_lse"] = torch.full((B, T), float("nan"))
        for b, row in enumerate(rows):
            t = 0
            for i in row:
                item, n = self._item(_sample(i)), self.lengths[_sample(i)]
                if i < 0:
                    item["loss_mask"] = torch.zeros_like(item["loss_mask"])
                for key, value in item.items():
                    batch[key][b, t : t + n] = value
                batch["attention_mask"][b, t : t + n] = 1
                batch["position_ids"][b, t : t + n] = torch.arange(n)
                t += n
            batch["position_ids"][b, t:] = torch.arange(n, n + T - t)  # padding continues the last sample
        return batch

    def finish(self, batch: DraftBatch) -> DraftBatch:
        """A staged batch with an encoded set's `hidden` decoded on the device; plain batches as they are."""
        if self.encoded:
            parts = {k.removeprefix("parts."): batch.pop(k) for k in list(batch) if k.startswith("parts.")}
            batch["hidden"] = self._decode(parts, batch)
        return batch

    def _decode(self, parts: dict[str, torch.Tensor], batch: DraftBatch) -> torch.Tensor:
        """(B, T, ...) stored tensors -> (B, T, n, d) float32 on `self.device`: the real tokens decoded, padding 0."""
        ds = self.samples
        B, T = batch["input_ids"].shape
        if ds.codec.zeros_decode_to_zero:  # fp8: the whole batch, padding too, beats gathering the real tokens
            flat = {k: v.reshape(B * T, *v.shape[2:]).to(self.device, non_blocking=True) for k, v in parts.items()}
            return ds.codec.decode(flat).view(B, T, len(ds.layers), ds.hidden_size)
        real = batch["attention_mask"].reshape(-1).nonzero().squeeze(1)  # (N,) positions of real tokens
        flat = {k: v.reshape(B * T, *v.shape[2:])[real].to(self.device, non_blocking=True) for k, v in parts.items()}
        hidden = torch.zeros(B * T, len(ds.layers), ds.hidden_size, device=self.device)
        hidden[real.to(self.device)] = ds.codec.decode(flat)
        return hidden.view(B, T, len(ds.layers), ds.hidden_size)
