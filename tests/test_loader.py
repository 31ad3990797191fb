"""Batching, packing, rank sharding and exact resume of data.loader: `pytest tests/test_loader.py`."""

from __future__ import annotations

import random

import pytest
import torch

from data.loader import BatchLoader
from data.shards import FeatureDataset, FeatureShardWriter
from models.common import packed_additive_mask, packed_causal_mask

D, LAYERS = 8, [1, -1]


def token_samples(n: int, seed: int = 0, max_len: int = 20) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        T = rng.randint(1, max_len)
        out.append({"id": 1000 + i, "input_ids": [rng.randrange(3, 8192) for _ in range(T)], "loss_mask": [1] * T})
        out[-1]["loss_mask"][0] = 0
    return out


@pytest.fixture
def features(tmp_path) -> tuple[FeatureDataset, list[dict]]:
    """A real shard directory whose hidden values encode (sample, token, slot) so misplacements show."""
    samples = token_samples(11)
    writer = FeatureShardWriter(
        tmp_path,
        {"target": {"name": "t"}, "layers": LAYERS, "hidden_size": D, "dtype": "float32", "template": "x"},
        shard_tokens=40,
    )
    for k, s in enumerate(samples):
        T = len(s["input_ids"])
        hidden = torch.arange(T * len(LAYERS) * D, dtype=torch.float32).view(T, len(LAYERS), D) + 10_000 * k
        s["hidden"] = hidden
        writer.add(s["id"], torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"]), hidden)
    writer.close()
    return FeatureDataset(tmp_path), samples


def test_padding_collation(features) -> None:
    ds, samples = features
    loader = BatchLoader(ds, batch_size=4, shuffle=False)
    batch = next(loader.epoch(0))
    rows = loader.plan(0)[0]
    T = max(len(samples[r[0]]["input_ids"]) for r in rows)
    assert batch["input_ids"].shape == (4, T) and batch["hidden"].shape == (4, T, len(LAYERS), D)
    for b, (i,) in enumerate(rows):
        s, n = samples[i], len(samples[i]["input_ids"])
        assert batch["input_ids"][b, :n].tolist() == s["input_ids"]
        assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (T - n)
        assert batch["loss_mask"][b].tolist() == [float(m) for m in s["loss_mask"]] + [0.0] * (T - n)
        assert batch["position_ids"][b].tolist() == list(range(T))  # pads continue: no new segment starts
        assert torch.equal(batch["hidden"][b, :n], s["hidden"]) and not batch["hidden"][b, n:].any()


def test_packing_restarts_positions_per_sample(features) -> None:
    ds, samples = features
    loader = BatchLoader(ds, batch_size=2, packing=True, max_len=32, seed=3)
    seen = []
    for rows, batch in zip(loader.plan(0), loader.epoch(0)):
        for b, row in enumerate(rows):
            t = 0
            for i in row:
                n = len(samples[i]["input_ids"])
                assert batch["position_ids"][b, t : t + n].tolist() == list(range(n))
                assert batch["input_ids"][b, t : t + n].tolist() == samples[i]["input_ids"]
                assert torch.equal(batch["hidden"][b, t : t + n], samples[i]["hidden"])
                t += n
                seen.append(i)
            assert t <= 32 and batch["attention_mask"][b, t:].sum() == 0 and batch["loss_mask"][b, t:].sum() == 0
    assert sorted(seen) == list(range(len(samples)))
    assert any(len(row) > 1 for rows in loader.plan(0) for row in rows)  # it did pack


def test_packed_causal_mask_matches_brute_force() -> None:
    """The drafters' and online training's attention mask on packed, padded rows, against the loader's plan."""
    samples = token_samples(12, seed=5)
    loader = BatchLoader(samples, batch_size=3, packing=True, max_len=32, seed=2)
    rows, batch = loader.plan(0)[0], next(loader.epoch(0))
    assert any(len(row) > 1 for row in rows) and not batch["attention_mask"].all()  # packed and padded
    B, T = batch["input_ids"].shape
    want = torch.zeros(B, T, T, dtype=torch.bool)
    for b, row in enumerate(rows):
        sample: list[int] = []  # per token: which sample of the row (padding continues the last one's positions)
        for k, i in enumerate(row):
            sample += [k] * len(samples[i]["input_ids"])
        real = [True] * len(sample) + [False] * (T - len(sample))
        sample += [len(row) - 1] * (T - len(sample))
        for q in range(T):
            for k in range(T):
                want[b, q, k] = (k <= q and sample[k] == sample[q] and real[k]) or k == q
    assert torch.equal(packed_causal_mask(batch), want)
    additive = packed_additive_mask(batch, torch.bfloat16)
    assert additive.shape == (B, 1, T, T) and additive.dtype == torch.bfloat16
    assert torch.equal(additive[:, 0] == 0, want) and (additive[:, 0][~want] == torch.finfo(torch.bfloat16).min).all()


@pytest.mark.parametrize("packing", [False, True])
def test_ranks_get_disjoint_equal_shares(packing: bool) -> None:
    samples = token_samples(30)
    kw = dict(batch_size=3, packing=packing, max_len=24, seed=1)
    loaders = [BatchLoader(samples, list(range(2, 29)), rank=r, world_size=3, **kw) for r in range(3)]
    plans = [[i for rows in loader.plan(5) for row in rows for i in row] for loader in loaders]
    assert len({len(loader) for loader in loaders}) == 1  # DDP ranks stay in step
    if not packing:  # 27 samples over 3 ranks: no wrap-around, so the shares are disjoint
        assert not (set(plans[0]) & set(plans[1]) or set(plans[1]) & set(plans[2]) or set(plans[0]) & set(plans[2]))
    assert set().union(*plans) == set(range(2, 29))
    # an uneven split wraps around instead of leaving a rank short
    uneven = [BatchLoader(samples, list(range(7)), batch_size=2, rank=r, world_size=2) for r in range(2)]
    assert len(uneven[0]) == len(uneven[1]) == 2


def test_resume_replays_the_same_batches_across_epochs() -> None:
    samples = token_samples(10)
    a = BatchLoader(samples, batch_size=3, seed=7, rank=1, world_size=2)  # 2 batches per epoch
    stream = a.batches()
    for _ in range(3):  # into the second epoch
        next(stream)
    state = a.state_dict()
    assert state == {"epoch": 1, "rows": 6}
    expected = [next(stream) for _ in range(4)]
    b = BatchLoader(samples, batch_size=3, seed=7, rank=1, world_size=2)
    b.load_state_dict(state)
    got = [batch for batch, _ in zip(b.batches(), range(4))]
    for x, y in zip(expected, got):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert a.plan(0) != a.plan(1)  # a new shuffle every epoch
    assert BatchLoader(samples, batch_size=3, seed=8).plan(0) != BatchLoader(samples, batch_size=3, seed=7).plan(0)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("saved,resumed", [((2, 1), (1, 2)), ((1, 2), (2, 1)), ((4, 1), (2, 2))])
def test_a_position_saved_by_n_processes_resumes_on_m(saved, resumed, packing) -> None:
    """(processes, accum) with the same global step: every optimizer step reads the same rows after the restore."""
    samples = token_samples(23)
    kw = dict(batch_size=2, packing=packing, max_len=24, seed=3)

    def steps(loaders, accum, n):  # the set of sample positions each of n optimizer steps reads, over all ranks
        streams = [loader.batches() for loader in loaders]
        out = []
        for _ in range(n):
            rows = []
            for stream in streams:
                for _ in range(accum):
                    batch = next(stream)
                    rows += [tuple(r[m > 0].tolist()) for r, m in zip(batch["input_ids"], batch["attention_mask"])]
            out.append(sorted(rows))
        return out

    (n_a, acc_a), (n_b, acc_b) = saved, resumed
    a = [BatchLoader(samples, rank=r, world_size=n_a, accum=acc_a, **kw) for r in range(n_a)]
    uninterrupted = steps(a, acc_a, 9)  # across an epoch boundary
    a = [BatchLoader(samples, rank=r, world_size=n_a, accum=acc_a, **kw) for r in range(n_a)]
    steps(a, acc_a, 4)
    states = [loader.state_dict() for loader in a]
    assert len({tuple(s.items()) for s in states}) == 1  # one position, whatever the rank
    b = [BatchLoader(samples, rank=r, world_size=n_b, accum=acc_b, **kw) for r in range(n_b)]
    for loader in b:
        loader.load_state_dict(states[0])
    assert steps(b, acc_b, 5) == uninterrupted[4:]


def test_a_position_off_the_batch_grid_is_refused() -> None:
    loader = BatchLoader(token_samples(10), batch_size=4, world_size=1)
    with pytest.raises(ValueError, match="not a whole number of batches"):
        loader.load_state_dict({"epoch": 0, "rows": 6})


@pytest.mark.parametrize("packing", [False, True])
def test_an_unscored_fill_counts_every_sample_once_on_any_number_of_processes(features, packing) -> None:
    """Held-out evaluation's loader: the rows repeated to fill the last step keep their tokens (every process runs
    the same number of batches) but carry no loss tokens, so each sample's loss tokens count exactly once."""
    ds, samples = features
    want = sum(sum(s["loss_mask"]) for s in samples)
    for world in (1, 2, 3):
        scored, tokens = 0.0, 0
        for rank in range(world):
            loader = BatchLoader(ds, batch_size=4, shuffle=False, packing=packing, max_len=40, rank=rank,
                                 world_size=world, score_fill=False)  # fmt: skip
            for batch in loader.epoch(0):
                scored += float(batch["loss_mask"].sum())
                tokens += int(batch["attention_mask"].sum())
        assert scored == want
        assert tokens >= sum(len(s["input_ids"]) for s in samples)  # the repeats are there, unscored
    # the training loader's fill is scored: 11 rows on 2 processes of 4 fill to 16, 5 samples counted twice
    training = [BatchLoader(ds, batch_size=4, shuffle=False, rank=r, world_size=2) for r in range(2)]
    assert sum(float(b["loss_mask"].sum()) for loader in training for b in loader.epoch(0)) > want


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "pca"])
@pytest.mark.parametrize("packing", [False, True])
def test_encoded_features_are_decoded_a_batch_at_a_time(tmp_path, dtype: str, packing: bool) -> None:
    """An encoded store's batches carry float32 states decoded on the loader's device: each row's tokens are what
    the dataset decodes for its samples (per sample), padding is 0, and everything else is as for plain features."""
    from data.codecs import PcaCodec

    samples = token_samples(11, max_len=30)
    g = torch.Generator().manual_seed(0)
    d = 32
    mix = torch.randn(d, d, generator=g)
    hidden = {s["id"]: torch.randn(len(s["input_ids"]), len(LAYERS), d, generator=g) @ mix for s in samples}
    header = {"target": {"name": "t"}, "layers": LAYERS, "hidden_size": d, "dtype": dtype, "template": "x"}
    codec = PcaCodec.fit(torch.cat(list(hidden.values())), [4.0, 4.0]) if dtype == "pca" else None
    writer = FeatureShardWriter(tmp_path, header, shard_tokens=60, codec=codec)
    for s in samples:
        writer.add(s["id"], torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"]), hidden[s["id"]])
    writer.close()
    ds = FeatureDataset(tmp_path)
    loader = BatchLoader(ds, batch_size=3, packing=packing, max_len=40, shuffle=True, device="cpu")
    for rows, batch in zip(loader.plan(0), loader.epoch(0)):
        assert batch["hidden"].dtype == torch.float32 and batch["hidden"].shape[2:] == (len(LAYERS), d)
        assert not any(k.startswith("parts") for k in batch)
        for b, row in enumerate(rows):
            t = 0
            for i in row:
                n = loader.lengths[i]
                want = ds[i]["hidden"][:n]
                torch.testing.assert_close(batch["hidden"][b, t : t + n], want, rtol=1e-5, atol=1e-5)
                assert torch.equal(batch["input_ids"][b, t : t + n], ds[i]["input_ids"][:n])
                t += n
            assert not batch["hidden"][b, t:].any()
    # within the encoding's error of what was written
    got = torch.cat([ds[i]["hidden"] for i in range(len(ds))])
    want = torch.cat([hidden[i] for i in ds.sample_ids])
    assert (got - want).pow(2).mean().sqrt() < 0.1 * want.pow(2).mean().sqrt()


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "pca"])
def test_encoded_batches_decode_on_the_device_asked_for(tmp_path, dtype: str) -> None:
    """The loader decodes on the training device (`device`): here the CPU given explicitly against the default; on
    a GPU `benchmarks/gpu_kernels.py` compares the CUDA decode with the CPU one."""
    from data.codecs import PcaCodec

    samples = token_samples(8, max_len=30)
    hidden = {s["id"]: torch.randn(len(s["input_ids"]), len(LAYERS), 32) for s in samples}
    header = {"target": {"name": "t"}, "layers": LAYERS, "hidden_size": 32, "dtype": dtype, "template": "x"}
    codec = PcaCodec.fit(torch.cat(list(hidden.values())), [4.0, 4.0]) if dtype == "pca" else None
    writer = FeatureShardWriter(tmp_path, header, shard_tokens=60, codec=codec)
    for s in samples:
        writer.add(s["id"], torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"]), hidden[s["id"]])
    writer.close()
    ds = FeatureDataset(tmp_path)
    on = {dev: next(BatchLoader(ds, batch_size=4, shuffle=False, device=dev).batches()) for dev in (None, "cpu")}
    assert on["cpu"]["hidden"].device.type == "cpu" and on["cpu"]["hidden"].dtype == torch.float32
    torch.testing.assert_close(on["cpu"]["hidden"], on[None]["hidden"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "fp8_e4m3"])
def test_reading_ahead_changes_neither_batches_nor_resume_states(tmp_path, dtype: str, monkeypatch) -> None:
    """With `read_ahead` the next batch is read on a thread while this one is used: the batches, and the state after
    each one, are those of a loader that reads in turn, across epochs and after a restore; and a loader kept reading
    on its thread while the same dataset serves another one (training and held-out evaluation share it)."""
    import threading

    samples = token_samples(10, max_len=30)
    header = {"target": {"name": "t"}, "layers": LAYERS, "hidden_size": D, "dtype": dtype, "template": "x"}
    writer = FeatureShardWriter(tmp_path, header, shard_tokens=50)
    for s in samples:
        hidden = torch.randn(len(s["input_ids"]), len(LAYERS), D)
        writer.add(s["id"], torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"]), hidden)
    writer.close()
    ds = FeatureDataset(tmp_path)
    threads = set()
    stage = BatchLoader.stage
    monkeypatch.setattr(BatchLoader, "stage", lambda self, rows: threads.add(threading.current_thread()) or
                        stage(self, rows))  # fmt: skip

    def run(read_ahead: bool, state=None, n: int = 9) -> list[tuple[dict, dict]]:
        loader = BatchLoader(ds, batch_size=3, seed=3, read_ahead=read_ahead)  # 4 batches an epoch
        if state is not None:
            loader.load_state_dict(state)
        stream = loader.batches()
        other = BatchLoader(ds, batch_size=2, shuffle=False, read_ahead=read_ahead)
        out = []
        for _ in range(n):
            out.append((next(stream), loader.state_dict()))
            list(other.epoch(0))  # the same dataset read meanwhile
        return out

    plain, ahead = run(False), run(True)
    assert threads - {threading.main_thread()}, "read-ahead reads on a thread"
    for (x, sx), (y, sy) in zip(plain, ahead):
        assert sx == sy and x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert [s for _, s in ahead][3:5] == [{"epoch": 0, "rows": 12}, {"epoch": 1, "rows": 3}]
    resumed = run(True, state=ahead[4][1], n=4)
    for (x, sx), (y, sy) in zip(ahead[5:], resumed):
        assert sx == sy and all(torch.equal(x[k], y[k]) for k in x)


def test_cold_loader_benchmark_reads_whole_sets_against_bf16(tmp_path, capsys) -> None:
    """`benchmarks/feature_store.py --cold-sets`: one epoch of each whole set from the disk, each encoded set's rate
    against the bf16 one; a first set that is not bf16 is refused naming it."""
    from benchmarks.feature_store import cold_sets

    samples = token_samples(6, max_len=30)
    hidden = [torch.randn(len(s["input_ids"]), len(LAYERS), D) for s in samples]
    for dtype in ("bfloat16", "fp8_e4m3"):
        header = {"target": {"name": "t"}, "layers": LAYERS, "hidden_size": D, "dtype": dtype, "template": "x"}
        writer = FeatureShardWriter(tmp_path / dtype, header, shard_tokens=50)
        for s, h in zip(samples, hidden):
            writer.add(s["id"], torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"]), h)
        writer.close()
    ratios = cold_sets([tmp_path / "bfloat16", tmp_path / "fp8_e4m3"], torch.device("cpu"))
    assert set(ratios) == {"fp8_e4m3"} and ratios["fp8_e4m3"] > 0
    tokens = f"{sum(len(s['input_ids']) for s in samples):,} tokens"
    assert capsys.readouterr().out.count(tokens) == 2
    with pytest.raises(SystemExit, match="fp8_e4m3.* is fp8_e4m3"):
        cold_sets([tmp_path / "fp8_e4m3", tmp_path / "bfloat16"], torch.device("cpu"))
