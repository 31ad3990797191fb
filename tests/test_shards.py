"""Feature shard format, manifest checks and checksums: `pytest tests/test_shards.py`."""

from __future__ import annotations

import hashlib
import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file

from data import codecs, shards
from data.files import file_sha256
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


def flip_byte(path, offset: int = -5) -> None:
    """Flip the bits of one byte inside the tensor payload: same size, different content."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_is_refused_naming_the_shard(tmp_path) -> None:
    write(tmp_path, random_samples(6))
    flip_byte(tmp_path / "shard-00001.safetensors")
    # on by default: the size still matches, only the checksum can tell; one line names the shard, the manifest,
    # and the repair
    with pytest.raises(FeatureMismatchError) as refused:
        FeatureDataset(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'shard-00001.safetensors'}: sha256 ") and "\n" not in message
    assert f"{tmp_path / 'manifest.json'} says" in message
    assert message.endswith("re-run `python -m data.extract RECIPE` to repair it")
    FeatureDataset(tmp_path, verify_checksums=False)  # the opt-out skips the hashing ...
    path = tmp_path / "shard-00001.safetensors"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(FeatureMismatchError, match=r"shard-00001.safetensors: \d+ bytes where .*manifest.json says"):
        FeatureDataset(tmp_path, verify_checksums=False)  # ... not the size check
    path.unlink()
    with pytest.raises(FileNotFoundError, match="shard-00001.safetensors: missing, listed in .*manifest.json"):
        FeatureDataset(tmp_path)


def test_foreign_shard_is_refused(tmp_path) -> None:
    """Another run's shard of the same samples has the same size; its sha256 is not the manifest's."""
    samples = random_samples(6)
    other = [dict(s, hidden=s["hidden"] + 1) for s in samples]
    write(tmp_path / "ours", samples)
    write(tmp_path / "theirs", other)
    ours, theirs = tmp_path / "ours/shard-00001.safetensors", tmp_path / "theirs/shard-00001.safetensors"
    assert ours.stat().st_size == theirs.stat().st_size and ours.read_bytes() != theirs.read_bytes()
    ours.write_bytes(theirs.read_bytes())
    with pytest.raises(FeatureMismatchError, match=r"ours/shard-00001.safetensors: sha256 .*ours/manifest.json says"):
        FeatureDataset(tmp_path / "ours")
    FeatureDataset(tmp_path / "theirs")


def test_a_shard_that_links_out_of_its_directory_is_refused(tmp_path) -> None:
    """A faithful copy of the shard outside the directory, linked in its place: same bytes, same sha256, and still
    refused (with or without hashing); a link to a file inside the directory is read."""
    features = tmp_path / "features"
    write(features, random_samples(6))
    shard = features / "shard-00001.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    for verify in (True, False):
        with pytest.raises(FeatureMismatchError) as refused:
            FeatureDataset(features, verify_checksums=verify)
        message = str(refused.value)
        assert message.startswith(f"{shard}: a symbolic link to {outside}, outside {features}") and "\n" not in message
    shard.unlink()
    inside = features / "kept.bin"
    inside.write_bytes(outside.read_bytes())
    shard.symlink_to(inside.name)
    assert len(FeatureDataset(features)) == 6


@pytest.mark.parametrize("name", ["../x.safetensors", "ABSOLUTE", "sub/x.safetensors", "..", ""])
def test_manifest_names_only_bare_file_names(tmp_path, name: str) -> None:
    features = tmp_path / "features"
    write(features, random_samples(6))
    if name == "ABSOLUTE":
        name = str(tmp_path / "abs" / "path.safetensors")
    if name not in ("", ".."):  # a faithful copy of the shard there: only the name can be refused
        (features / name).parent.mkdir(parents=True, exist_ok=True)
        (features / name).write_bytes((features / "shard-00001.safetensors").read_bytes())
    manifest = json.loads((features / "manifest.json").read_text())
    manifest["shards"][1]["file"] = name
    (features / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FeatureMismatchError) as refused:
        FeatureDataset(features)
    assert str(refused.value).startswith(f"{features / 'manifest.json'}: shards[1] names file {name!r}; ")
    assert "bare file name" in str(refused.value)


def test_each_shard_is_hashed_once_at_open(tmp_path, monkeypatch) -> None:
    manifest = write(tmp_path, random_samples(12), shard_tokens=8)
    hashed = []
    monkeypatch.setattr(shards, "file_sha256", lambda path: hashed.append(path) or file_sha256(path))
    ds = FeatureDataset(tmp_path, max_open_shards=1)
    assert sorted(hashed) == [tmp_path / e["file"] for e in manifest["shards"]]
    for i in [*range(len(ds)), *range(len(ds))]:  # reading (and reopening evicted shards) hashes nothing more
        ds[i]
    assert len(hashed) == len(manifest["shards"])


def test_verify_shards_hashes_every_nth_shard(tmp_path, monkeypatch) -> None:
    """N training processes split the hashing: rank r hashes shards r, r + N, ...; each shard once over all ranks."""
    manifest = write(tmp_path, random_samples(12), shard_tokens=8)
    files = [tmp_path / e["file"] for e in manifest["shards"]]
    assert len(files) >= 4
    hashed = []
    monkeypatch.setattr(shards, "file_sha256", lambda path: hashed.append(path) or file_sha256(path))
    FeatureDataset(tmp_path, verify_shards=(1, 2))
    assert sorted(hashed) == files[1::2]
    hashed.clear()
    FeatureDataset(tmp_path, verify_shards=(0, 2))
    assert sorted(hashed) == files[0::2]
    # a bad shard is found by the rank that hashes it only; sizes are still checked by every rank
    flip_byte(files[1])
    FeatureDataset(tmp_path, verify_shards=(0, 2))
    with pytest.raises(FeatureMismatchError, match=rf"^{re.escape(str(files[1]))}: sha256 "):
        FeatureDataset(tmp_path, verify_shards=(1, 2))
    files[3].write_bytes(files[3].read_bytes()[:-1])
    with pytest.raises(FeatureMismatchError, match=rf"^{re.escape(str(files[3]))}: \d+ bytes where "):
        FeatureDataset(tmp_path, verify_shards=(0, 2))
    with pytest.raises(ValueError, match="verify_shards"):
        FeatureDataset(tmp_path, verify_shards=(2, 2))


def test_file_sha256_matches_hashlib(tmp_path) -> None:
    for size in (0, 1, 5 << 20):
        path = tmp_path / f"f{size}"
        path.write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
        assert file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()


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


# ------------------------------------------------------------------------------------------------ encoded storage

ED, ELAYERS = 64, [1, -1]


def structured_hidden(T: int, seed: int = 0) -> torch.Tensor:
    """(T, 2, 64) states shaped like a model's: correlated channels with a falling spectrum, an offset, and tokens of
    different norms (what a per-layer basis and per-token scales are for)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(2, ED, ED, generator=torch.Generator().manual_seed(99))  # the same axes in every sample
    spectrum = torch.logspace(0, -2, ED)
    z = torch.randn(T, 2, ED, generator=g) * spectrum
    norms = torch.exp(torch.randn(T, 1, 1, generator=g) * 0.3)
    return torch.einsum("tnk,nkd->tnd", z, mix) * norms + torch.linspace(-1, 1, ED)


def encoded_samples(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(20, 60, (1,), generator=g))
        out.append(
            {
                "id": i,
                "input_ids": torch.randint(0, 8192, (T,), generator=g),
                "loss_mask": torch.randint(0, 2, (T,), generator=g),
                "hidden": structured_hidden(T, seed + i),
            }
        )
    return out


def write_encoded(directory, samples, dtype: str, bits=3.8, shard_tokens=200) -> dict:
    header = {**HEADER, "layers": ELAYERS, "hidden_size": ED, "dtype": dtype}
    codec = None
    if dtype == "pca":
        fit = torch.cat([s["hidden"] for s in samples])
        codec = codecs.PcaCodec.fit(fit, codecs.bits_per_layer(bits, len(ELAYERS)))
    writer = FeatureShardWriter(directory, header, shard_tokens=shard_tokens, codec=codec)
    for s in samples:
        writer.add(s["id"], s["input_ids"], s["loss_mask"], s["hidden"])
    return writer.close()


# relative RMS error bound per layer on structured_hidden, and hidden bytes per token for 2 layers of 64 values
PCA_BYTES = 2 * (math.floor(3.8 * ED) - 16) // 8 + 2 * 2  # whole bytes of codes, then a float16 scale per layer
ENCODED = {"bfloat16": (0.004, 2 * 2 * ED), "fp8_e4m3": (0.035, 2 * (ED + 4)), "pca": (0.06, PCA_BYTES)}


@pytest.mark.parametrize("dtype", list(ENCODED))
def test_encoded_roundtrip_error_bytes_and_manifest(tmp_path, dtype: str) -> None:
    samples = encoded_samples(12)
    manifest = write_encoded(tmp_path, samples, dtype)
    bound, hidden_bytes = ENCODED[dtype]
    assert manifest["dtype"] == dtype and manifest["hidden_bytes_per_token"] == hidden_bytes
    assert manifest["format_version"] == (1 if dtype == "bfloat16" else 2)  # older readers refuse encoded sets
    ds = FeatureDataset(tmp_path, expect={"dtype": dtype})
    got = torch.cat([ds[i]["hidden"] for i in range(len(ds))])
    want = torch.cat([s["hidden"] for s in samples])
    assert got.dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32) and got.shape == want.shape
    errors = codecs.relative_rms(got, want)
    assert max(errors) < bound, errors
    raw = load_file(tmp_path / "shard-00000.safetensors")
    T0 = manifest["shards"][0]["num_tokens"]
    extra = 0
    if dtype == "bfloat16":
        assert "encoding" not in manifest and set(raw) == {"input_ids", "loss_mask", "hidden", "offsets", "sample_ids"}
    else:
        assert raw["hidden_scale"].shape == (T0, len(ELAYERS))
        assert manifest["encoding"]["name"] == dtype and manifest["encoding"]["payload_bytes"] == hidden_bytes
    if dtype == "fp8_e4m3":
        assert raw["hidden"].dtype == torch.float8_e4m3fn and raw["hidden_scale"].dtype == torch.float32
    if dtype == "pca":
        encoding = manifest["encoding"]
        assert raw["hidden"].dtype == torch.uint8 and raw["hidden_scale"].dtype == torch.float16
        assert raw["hidden"].shape == (T0, hidden_bytes - 4)
        assert encoding["bits"] == [3.8, 3.8] and all(0 < kept < ED for kept in encoding["kept"])  # tail axes: 0 bits
        assert encoding["basis"] == "basis.safetensors"
        assert encoding["basis_sha256"] == file_sha256(tmp_path / "basis.safetensors")
        extra = encoding["basis_bytes"] == (tmp_path / "basis.safetensors").stat().st_size and encoding["basis_bytes"]
        assert extra
    # every file of the set counts: shards and the basis
    assert manifest["total_bytes"] == sum(e["bytes"] for e in manifest["shards"]) + extra
    assert manifest["bytes_per_token"] == manifest["total_bytes"] / manifest["num_tokens"]


def test_pca_bits_buy_accuracy_and_fit_is_deterministic(tmp_path) -> None:
    samples = encoded_samples(12)
    hidden = torch.cat([s["hidden"] for s in samples])
    errors = {}
    for bits in (2.0, 3.8, 6.0):
        codec = codecs.PcaCodec.fit(hidden, [bits, bits])
        assert codec.bytes_per_token <= bits * 2 * ED / 8
        errors[bits] = max(codecs.relative_rms(codec.decode(codec.encode(hidden)), hidden))
    assert errors[2.0] > errors[3.8] > 2 * errors[6.0]
    # one fit, one basis file: the same data fits to the same bytes
    for name in ("a", "b"):
        codecs.PcaCodec.fit(hidden, [3.8, 3.8]).save(tmp_path / name)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    codec, _ = codecs.PcaCodec.load(tmp_path / "a")
    again = codecs.PcaCodec.fit(hidden, [3.8, 3.8])
    assert torch.equal(codec.decode(codec.encode(hidden)), again.decode(again.encode(hidden)))


def test_pca_keeps_ordinary_tokens_accurate_beside_massive_activations() -> None:
    """1% of the tokens at 150x the median norm along one direction (attention sinks, as trained LLMs' middle layers
    have them) must not take the bits: ordinary tokens and the massive ones both stay within a few percent."""
    hidden = structured_hidden(4000, seed=3) * 1000  # large states: the float16 per-token scales must still fit
    massive = torch.zeros(len(hidden), dtype=torch.bool)
    massive[::100] = True
    direction = torch.nn.functional.normalize(torch.randn(ED, generator=torch.Generator().manual_seed(5)), dim=0)
    hidden[massive, 0] += 150 * hidden[:, 0].norm(dim=-1).median() * direction
    codec = codecs.PcaCodec.fit(hidden, [3.8, 3.8])
    parts = codec.encode(hidden)
    assert torch.isfinite(parts["hidden_scale"].float()).all()
    back = codec.decode(parts)
    relative = (back[:, 0] - hidden[:, 0]).norm(dim=-1) / hidden[:, 0].norm(dim=-1)
    ordinary = relative[~massive].median()
    assert ordinary < 0.05, f"ordinary tokens at {ordinary:.3f} relative error"
    assert relative[massive].median() < 0.05
    assert max(codecs.relative_rms(back, hidden)) < 0.05


def test_pca_codes_pack_and_unpack_exactly() -> None:
    """Codes of 1..8 bits, packed end to end across byte boundaries, come back as they were."""
    hidden = structured_hidden(300)
    codec = codecs.PcaCodec.fit(hidden, [5.0, 2.5])
    bits = torch.cat([layer["bits"].long() for layer in codec.layers])
    assert bits.min() >= 1 and bits.max() <= 8 and len(set(bits.tolist())) >= 4
    codes = torch.stack([torch.randint(0, 1 << int(b), (50,)) for b in bits], 1).to(torch.int32)
    assert torch.equal(codec.unpack(codec._pack(codes)), codes)


def test_fp8_decode_by_table_equals_torchs_conversion() -> None:
    """Every e4m3 byte (subnormals, ±0, the largest, NaN) decodes by the table as torch converts it, times its row's
    scale."""
    codec = codecs.make_codec("fp8_e4m3", n_layers=2, hidden_size=128)
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(1, 256)
    scale = torch.tensor([[0.5, 3.0]])
    got = codec.decode({"hidden": q, "hidden_scale": scale})
    want = q.view(1, 2, 128).float() * scale[..., None]
    assert got.dtype == torch.float32 and got.shape == (1, 2, 128)
    assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) == 2  # 0x7f and 0xff
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_a_damaged_basis_is_refused_naming_it(tmp_path) -> None:
    write_encoded(tmp_path, encoded_samples(6), "pca")
    basis = tmp_path / "basis.safetensors"
    flip_byte(basis, offset=-7)
    with pytest.raises(FeatureMismatchError) as refused:
        FeatureDataset(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"{basis}: sha256 ") and f"{tmp_path / 'manifest.json'} says" in message
    assert "corrupted, edited or foreign basis" in message and message.endswith("to repair it")
    basis.write_bytes(basis.read_bytes()[:-1])
    with pytest.raises(FeatureMismatchError, match=r"basis.safetensors: \d+ bytes where .* foreign basis"):
        FeatureDataset(tmp_path, verify_checksums=False)
    basis.unlink()
    with pytest.raises(FileNotFoundError, match="basis.safetensors: missing, listed in .*manifest.json"):
        FeatureDataset(tmp_path)


def test_an_encoded_shard_is_checked_like_any(tmp_path) -> None:
    write_encoded(tmp_path, encoded_samples(6), "fp8_e4m3", shard_tokens=60)
    flip_byte(tmp_path / "shard-00001.safetensors")
    with pytest.raises(FeatureMismatchError, match=rf"^{re.escape(str(tmp_path / 'shard-00001.safetensors'))}: sha"):
        FeatureDataset(tmp_path)
