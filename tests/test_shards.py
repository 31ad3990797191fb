"""Feature shard format, manifest checks and checksums: `pytest tests/test_shards.py`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from data.shards import FeatureDataset, FeatureMismatchError, FeatureShardWriter, split_by_id

D, LAYERS = 16, [0, -1]
HEADER = {
    "target": {"name": "t", "model_type": "llama", "config_sha256": "abc", "weights_sha256": "def"},
    "layers": LAYERS,
    "hidden_size": D,
    "dtype": "bfloat16",
    "template": "tmpl",
}


def random_samples(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(1, 12, (1,), generator=g))
        out.append(
            {
                "id": 100 + 3 * i,
                "input_ids": torch.randint(0, 8192, (T,), generator=g),
                "loss_mask": torch.randint(0, 2, (T,), generator=g),
                "hidden": torch.randn(T, len(LAYERS), D, generator=g),
            }
        )
    return out


def write(directory, samples, shard_tokens=20) -> dict:
    writer = FeatureShardWriter(directory, HEADER, shard_tokens=shard_tokens)
    for s in samples:
        writer.add(s["id"], s["input_ids"], s["loss_mask"], s["hidden"])
    return writer.close()


def test_roundtrip_and_exact_tensor_format(tmp_path) -> None:
    samples = random_samples(9)
    manifest = write(tmp_path, samples)
    assert len(manifest["shards"]) >= 3 and not list(tmp_path.glob("*.tmp"))
    assert manifest["num_samples"] == 9 and manifest["num_tokens"] == sum(len(s["input_ids"]) for s in samples)
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest

    raw = load_file(tmp_path / "shard-00000.safetensors")
    n0, T0 = manifest["shards"][0]["num_samples"], manifest["shards"][0]["num_tokens"]
    assert T0 >= 20  # a shard closes at the first sample boundary past shard_tokens
    assert raw["input_ids"].dtype == torch.int32 and raw["input_ids"].shape == (T0,)
    assert raw["loss_mask"].dtype == torch.uint8 and raw["loss_mask"].shape == (T0,)
    assert raw["hidden"].dtype == torch.bfloat16 and raw["hidden"].shape == (T0, len(LAYERS) * D)
    assert raw["offsets"].dtype == torch.int64 and raw["offsets"].tolist()[0] == 0 and raw["offsets"][-1] == T0
    assert raw["sample_ids"].tolist() == [s["id"] for s in samples[:n0]]

    ds = FeatureDataset(tmp_path, verify_checksums=True, expect=HEADER)
    assert len(ds) == 9 and ds.sample_ids == [s["id"] for s in samples]
    for i, s in enumerate(samples):
        got = ds[i]
        assert got["id"] == s["id"]
        assert got["input_ids"].dtype == torch.int64 and torch.equal(got["input_ids"], s["input_ids"])
        assert got["loss_mask"].dtype == torch.float32 and torch.equal(got["loss_mask"], s["loss_mask"].float())
        assert got["hidden"].shape == s["hidden"].shape and got["hidden"].dtype == torch.bfloat16
        torch.testing.assert_close(got["hidden"], s["hidden"].to(torch.bfloat16), rtol=0, atol=0)
    # bytes per token: the hidden payload plus a few bytes
    assert manifest["hidden_bytes_per_token"] == 2 * D * len(LAYERS)
    assert manifest["hidden_bytes_per_token"] < manifest["bytes_per_token"] < manifest["hidden_bytes_per_token"] + 64


def test_lru_keeps_few_shards_open(tmp_path) -> None:
    write(tmp_path, random_samples(12), shard_tokens=8)
    ds = FeatureDataset(tmp_path, max_open_shards=2)
    for i in range(len(ds)):
        ds[i]
    assert len(ds._open) == 2


def test_expect_mismatch_names_the_field(tmp_path) -> None:
    write(tmp_path, random_samples(3))
    with pytest.raises(FeatureMismatchError, match=r"layers=\[0, -1\], expected \[-1\]"):
        FeatureDataset(tmp_path, expect={"layers": [-1]})
    other = dict(HEADER["target"], weights_sha256="zzz")
    with pytest.raises(FeatureMismatchError, match="target.weights_sha256"):
        FeatureDataset(tmp_path, expect={"target": other})
    # a different name (e.g. a moved model directory) is the same target
    FeatureDataset(tmp_path, expect={"target": dict(HEADER["target"], name="elsewhere")})


def test_checksum_detects_corrupted_shard(tmp_path) -> None:
    write(tmp_path, random_samples(6))
    path = tmp_path / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip bits inside the tensor payload: same size, different content
    path.write_bytes(bytes(data))
    FeatureDataset(tmp_path)  # size still matches: only the checksum can tell
    with pytest.raises(ValueError, match="shard-00001.safetensors: sha256 mismatch"):
        FeatureDataset(tmp_path, verify_checksums=True)
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(ValueError, match="bytes, manifest says"):
        FeatureDataset(tmp_path)


def test_split_is_deterministic_by_id() -> None:
    ids = list(range(1000, 1200))
    train, heldout = split_by_id(ids, 0.1, seed=0)
    assert len(heldout) == 20 and sorted(train + heldout) == list(range(200)) and not set(train) & set(heldout)
    assert split_by_id(ids, 0.1, seed=0) == (train, heldout)
    assert split_by_id(ids, 0.1, seed=1)[1] != heldout
    # the held-out *ids* do not depend on the order the samples are stored in
    rev = ids[::-1]
    assert {rev[i] for i in split_by_id(rev, 0.1, seed=0)[1]} == {ids[i] for i in heldout}
    assert split_by_id(ids, 0.0, seed=0) == (list(range(200)), [])
