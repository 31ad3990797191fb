"""Feature extraction end to end: `pytest tests/test_extract.py`.

Real tiny Llama target, real chat data through data.prepare, real shards; the multi-process test
launches `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tiny import accelerate_launch, reset_accelerate

from data.extract import STOP_AFTER_ENV, ExtractError, main
from data.extract_plan import length_batches, plan_shards
from data.files import file_sha256
from data.prepare import prepare_dataset
from data.shards import MANIFEST, FeatureDataset, FeatureMismatchError
from models.target import load_target
from schema.recipe import RecipeError, load_recipe
from train.__main__ import main as train_main

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat while every model learns to draft tokens quickly and well from its target".split()


def conversation(rng: random.Random) -> dict:
    say = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
    return {
        "messages": [
            {"role": "user", "content": say(rng.randint(2, 25))},
            {"role": "assistant", "content": say(rng.randint(2, 50))},
        ]
    }


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("extract")
    rng = random.Random(0)
    (root / "chat.jsonl").write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(30)))
    recipe = {
        "target": {
            "random_init": {
                "model_type": "llama",
                "vocab_size": 8192,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            },
            "tokenizer": str(ROOT / "recipes/pocket/target"),
            "dtype": "float32",
        },
        "data": {
            "train_files": [str(root / "chat.jsonl")],
            "layers": [0, 2, -1],
            "features_dir": str(root / "features"),
            "shard_tokens": 300,
            "extract_batch_tokens": 256,
            "max_len": 96,
        },
        "drafter": {"method": "medusa1"},
    }
    path = root / "extract.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_inprocess(recipe: Path, features: Path, *overrides: str) -> None:
    main([str(recipe), f"data.features_dir={features}", *overrides])


def shard_bytes(features: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(features.glob("shard-*.safetensors")) + [features / MANIFEST]}


@pytest.fixture(scope="module")
def reference(recipe_path: Path) -> Path:
    """One uninterrupted single-process extraction, shared by the tests below."""
    features = recipe_path.parent / "reference"
    run_inprocess(recipe_path, features)
    return features


def test_plan_and_batches_are_length_sorted() -> None:
    samples = [{"id": i, "input_ids": [1] * n, "loss_mask": [1] * n} for i, n in enumerate([5, 3, 9, 3, 7])]
    assert plan_shards(samples, shard_tokens=8) == [[1, 3, 0], [4, 2]]
    # each batch pads to its longest sample and stays within the token budget (one sample may exceed it)
    assert length_batches([3, 3, 5, 7, 9], batch_tokens=10) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert length_batches([2, 2, 2, 2], batch_tokens=100) == [(0, 4)]


def test_features_equal_direct_forward(recipe_path: Path, reference: Path) -> None:
    recipe = load_recipe(recipe_path)
    target = load_target(**vars(recipe.target))
    prepared = prepare_dataset(recipe.data, target.tokenizer)
    manifest = json.loads((reference / MANIFEST).read_text())
    assert len(manifest["shards"]) >= 4  # enough shards for resume and two processes to mean something
    assert manifest["num_samples"] == len(prepared.samples) == 30
    assert manifest["num_tokens"] == sum(len(s["input_ids"]) for s in prepared.samples)
    assert (reference / "recipe.yaml").is_file() and not list(reference.glob("manifest.part-*"))

    ds = FeatureDataset(reference, verify_checksums=True, expect={"target": target.identity(), "layers": [0, 2, -1]})
    by_id = {s["id"]: s for s in prepared.samples}
    assert sorted(ds.sample_ids) == sorted(by_id)
    for i in range(len(ds)):
        got = ds[i]
        sample = by_id[got["id"]]
        assert got["input_ids"].tolist() == sample["input_ids"]
        assert got["loss_mask"].tolist() == [float(m) for m in sample["loss_mask"]]
        with torch.inference_mode():
            ids = torch.tensor([sample["input_ids"]])
            ref = target.hidden_states(ids, layers=[0, 2, -1])[0]  # (T, 3, d), one sample, no padding
        assert got["hidden"].dtype == torch.bfloat16
        torch.testing.assert_close(got["hidden"].float(), ref, rtol=1e-2, atol=1e-4)


def test_killed_then_resumed_equals_uninterrupted(recipe_path: Path, reference: Path, monkeypatch) -> None:
    features = recipe_path.parent / "resumed"
    monkeypatch.setenv(STOP_AFTER_ENV, "1")
    with pytest.raises(SystemExit):
        run_inprocess(recipe_path, features)
    assert [p.name for p in features.glob("shard-*")] == ["shard-00000.safetensors"]
    assert not (features / MANIFEST).exists()  # nothing that looks complete
    monkeypatch.delenv(STOP_AFTER_ENV)
    run_inprocess(recipe_path, features)
    assert shard_bytes(features) == shard_bytes(reference)

    # a damaged shard (wrong size) is not trusted: it is extracted again, identically
    victim = features / "shard-00002.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])
    monkeypatch.setenv(STOP_AFTER_ENV, "1")
    with pytest.raises(SystemExit):
        run_inprocess(recipe_path, features)
    assert not (features / MANIFEST).exists()  # the old manifest no longer claims a complete directory
    monkeypatch.delenv(STOP_AFTER_ENV)
    run_inprocess(recipe_path, features)
    assert shard_bytes(features) == shard_bytes(reference)


def copy_features(reference: Path, features: Path) -> dict[str, int]:
    """A copy of the reference features; returns each shard's inode, to tell rewritten shards from kept ones."""
    shutil.copytree(reference, features)
    return {p.name: p.stat().st_ino for p in features.glob("shard-*.safetensors")}


def test_flipped_shard_is_refused_then_repaired(recipe_path: Path, reference: Path, tmp_path: Path, capfd) -> None:
    features = tmp_path / "features"
    inodes = copy_features(reference, features)
    victim = features / "shard-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the hidden states: same size
    victim.write_bytes(bytes(data))

    where = rf"^{re.escape(str(victim))}: sha256 .* {re.escape(str(features / MANIFEST))} says .*data.extract"
    with pytest.raises(FeatureMismatchError, match=where):
        FeatureDataset(features)
    # training refuses before any step, with one line naming the shard and what to do
    with pytest.raises(SystemExit) as refused:
        try:
            train_main([str(recipe_path), f"data.features_dir={features}", f"train.output_dir={tmp_path / 'run'}"])
        finally:
            reset_accelerate()
    message = str(refused.value.code)
    assert message.startswith("error: ") and "\n" not in message
    command = f"python -m data.extract {recipe_path} data.features_dir={features} train.output_dir={tmp_path / 'run'}"
    assert f"{victim}: sha256 " in message and f"re-run `{command}` to repair it" in message
    assert message.count("data.extract") == 1  # the fix, said once, naming the recipe

    # extraction re-extracts exactly that shard, to the same bytes as a clean extraction
    capfd.readouterr()
    run_inprocess(recipe_path, features)
    assert f"{victim}: sha256 " in capfd.readouterr().err
    assert shard_bytes(features) == shard_bytes(reference)
    after = {p.name: p.stat().st_ino for p in features.glob("shard-*.safetensors")}
    assert [name for name in inodes if after[name] != inodes[name]] == [victim.name]
    FeatureDataset(features)


def test_foreign_shard_is_refused_then_repaired(recipe_path: Path, reference: Path, tmp_path: Path) -> None:
    """A shard of another run (another target, same data: the same samples and size) swapped in."""
    other, features = tmp_path / "other", tmp_path / "features"
    run_inprocess(recipe_path, other, "target.seed=1")
    inodes = copy_features(reference, features)
    foreign = (other / "shard-00002.safetensors").read_bytes()
    assert len(foreign) == (features / "shard-00002.safetensors").stat().st_size
    (features / "shard-00002.safetensors").write_bytes(foreign)
    with pytest.raises(FeatureMismatchError, match=r"shard-00002.safetensors: sha256 .* says .* foreign shard"):
        FeatureDataset(features)
    run_inprocess(recipe_path, features)
    assert shard_bytes(features) == shard_bytes(reference)
    after = {p.name: p.stat().st_ino for p in features.glob("shard-*.safetensors")}
    assert [name for name in inodes if after[name] != inodes[name]] == ["shard-00002.safetensors"]


@pytest.mark.parametrize("name", [MANIFEST, "manifest.part-00001.json"])
def test_a_torn_manifest_is_named(recipe_path: Path, reference: Path, tmp_path: Path, name: str) -> None:
    """A manifest or part cut short (written before fsync-then-rename, or edited) stops a resume, and training, with
    its path, not a bare JSON error."""
    from data.shards import FeatureMismatchError, read_manifest

    features = tmp_path / "features"
    copy_features(reference, features)
    (features / name).write_text('{"format_version": 1, "sha')
    with pytest.raises(FeatureMismatchError, match=rf"^{features / name}: not a readable .*manifest"):
        run_inprocess(recipe_path, features)
    if name == MANIFEST:
        with pytest.raises(FeatureMismatchError, match=rf"^{features / name}: not a readable feature manifest"):
            read_manifest(features)


def test_checksums_are_on_by_default_and_not_a_setting(recipe_path: Path) -> None:
    on, off = load_recipe(recipe_path), load_recipe(recipe_path, ["data.verify_checksums=false"])
    assert on.data.verify_checksums and not off.data.verify_checksums
    # checkpoints compare these hashes on resume and export: turning the check off (or the default on) changes nothing
    assert on.section_hash("target", "data", "drafter") == off.section_hash("target", "data", "drafter")


def test_pca_settings_are_settings_of_pca_only(recipe_path: Path) -> None:
    """`data.storage_bits` and `data.storage_fit_tokens` change what pca features hold, so checkpoints hash them
    for pca; for other dtypes they mean nothing and are not hashed (checkpoints of before they existed still match).
    Impossible values are refused at load, naming the key."""
    hashed = lambda *o: load_recipe(recipe_path, list(o)).section_hash("target", "data", "drafter")  # noqa: E731
    assert hashed() == hashed("data.storage_bits=3", "data.storage_fit_tokens=5")
    assert hashed("data.storage_dtype=pca") != hashed("data.storage_dtype=pca", "data.storage_bits=3")
    assert hashed("data.storage_dtype=pca") != hashed("data.storage_dtype=pca", "data.storage_fit_tokens=5")
    for value, message in [("[3,3]", "lists 2 values for 3 data.layers"), ("0.5", r"within \[1, 8\]")]:
        with pytest.raises(RecipeError, match=rf"data.storage_bits: .*{message}"):
            load_recipe(recipe_path, ["data.storage_dtype=pca", f"data.storage_bits={value}"])


@pytest.mark.parametrize("key, value", [("max_loss_tokens", 100), ("max_repeat_run", 16)])
def test_a_setting_added_later_is_hashed_only_when_set(recipe_path: Path, key: str, value: int) -> None:
    """`data.max_loss_tokens` and `data.max_repeat_run` came after runs existed: unset (the default) they are left
    out of the hash, so their checkpoints still resume and export; set, they change the data, so they count."""
    default, limited = load_recipe(recipe_path), load_recipe(recipe_path, [f"data.{key}={value}"])
    assert key not in default.hashed_settings("data")["data"]
    assert limited.hashed_settings("data")["data"][key] == value
    assert default.section_hash("target", "data", "drafter") != limited.section_hash("target", "data", "drafter")


@pytest.mark.parametrize("name", ["../x.safetensors", "ABSOLUTE", "sub/x.safetensors"])
def test_manifest_entry_with_a_path_is_refused(recipe_path: Path, reference: Path, tmp_path: Path, name: str) -> None:
    features = tmp_path / "features"
    shutil.copytree(reference, features)
    if name == "ABSOLUTE":
        name = str(tmp_path / "abs" / "path.safetensors")
    # a faithful copy of the shard there: only the name is wrong
    (features / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(features / "shard-00001.safetensors", features / name)
    manifest = json.loads((features / MANIFEST).read_text())
    manifest["shards"][1]["file"] = name
    (features / MANIFEST).write_text(json.dumps(manifest))
    before = shard_bytes(features)
    entry = rf"{re.escape(str(features / MANIFEST))}: shards\[1\] names file {re.escape(repr(name))}; .* bare file name"
    with pytest.raises(FeatureMismatchError, match=f"^{entry}"):
        FeatureDataset(features)
    with pytest.raises(FeatureMismatchError, match=f"^{entry}"):
        run_inprocess(recipe_path, features)
    assert shard_bytes(features) == before


@pytest.mark.parametrize(
    "override, field",
    [
        ("data.layers=[0,-1]", "layers"),
        ("target.seed=1", "target.weights_sha256"),
        ("data.storage_dtype=float16", "dtype"),
        ("data.max_samples=10", "sources.max_samples"),
    ],
)
def test_mismatched_rerun_is_refused(recipe_path: Path, reference: Path, override: str, field: str) -> None:
    before = shard_bytes(reference)
    with pytest.raises(FeatureMismatchError, match=rf"built with ({field})="):
        run_inprocess(recipe_path, reference, override)
    assert shard_bytes(reference) == before


def test_other_template_is_refused(recipe_path: Path, reference: Path, tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(ROOT / "recipes/pocket/target", tokenizer)
    template = tokenizer / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|end|>", "<|end|> "))
    with pytest.raises(FeatureMismatchError, match="built with template="):
        run_inprocess(recipe_path, reference, f"target.tokenizer={tokenizer}")


def test_layer_out_of_range_fails_before_work(recipe_path: Path, tmp_path: Path) -> None:
    # a target loaded from a path: its config.json tells its depth when the recipe loads, as random_init does
    recipe = load_recipe(recipe_path)
    load_target(**vars(recipe.target)).model.save_pretrained(tmp_path / "model")
    path_target = ["target.random_init=", f"target.path={tmp_path / 'model'}"]
    with pytest.raises(RecipeError, match=r"data.layers\[0\]: layer 4 out of range for a 3-layer target"):
        run_inprocess(recipe_path, tmp_path / "never", *path_target, "data.layers=[4,-1]")
    assert not (tmp_path / "never").exists()


def test_features_that_overflow_float16_are_refused_naming_the_sample(recipe_path, tmp_path, monkeypatch) -> None:
    """A target whose activations exceed float16's range (65504) would store inf silently; extraction stops instead,
    naming the setting, a sample and the way out (`python -m data.extract` prints it as one `error:` line)."""
    from models.target import Target

    hidden_states = Target.hidden_states
    monkeypatch.setattr(Target, "hidden_states", lambda self, *a, **k: hidden_states(self, *a, **k) * 1e6)
    with pytest.raises(ExtractError, match=r"data.storage_dtype: sample \S+ has non-finite .* float16 .* use bfloat16"):
        run_inprocess(recipe_path, tmp_path / "f16", "data.storage_dtype=float16")


def test_a_second_extraction_into_the_same_directory_is_refused(recipe_path: Path, tmp_path: Path) -> None:
    """While another extraction writes data.features_dir (here: this test holds its lock), an extraction into it
    stops before reading or writing anything there, naming the directory and the holder; a features_dir that is a
    file is refused at load."""
    from rundir.lock import LOCK_FILE, DirectoryLocked, acquire, release

    features = tmp_path / "busy"
    held = acquire(features, "extraction")
    try:
        with pytest.raises(DirectoryLocked) as refused:
            run_inprocess(recipe_path, features)
        message = str(refused.value)
        assert message.startswith(f"{recipe_path}: data.features_dir: {features}: another extraction is writing there")
        assert f"(pid {os.getpid()}" in message and "\n" not in message
        assert sorted(p.name for p in features.iterdir()) == [LOCK_FILE]
    finally:
        release(held)
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(RecipeError, match=r"data.features_dir: .*a-file is a file, not a directory"):
        run_inprocess(recipe_path, tmp_path / "a-file")
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.slow
def test_two_processes_write_disjoint_shards_equal_to_one(recipe_path: Path, reference: Path) -> None:
    features = recipe_path.parent / "two-procs"
    cmd = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "data.extract",
        str(recipe_path),
        f"data.features_dir={features}",
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    # each process stops after its first shard: rank 0 wrote shard 0, rank 1 shard 1, each in its own part
    stopped = subprocess.run(cmd, cwd=ROOT, env={**env, STOP_AFTER_ENV: "1"}, capture_output=True, text=True)
    assert stopped.returncode != 0
    assert sorted(p.name for p in features.glob("shard-*")) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    parts = [json.loads((features / f"manifest.part-0000{r}.json").read_text())["shards"] for r in (0, 1)]
    assert [[e["index"] for e in part] for part in parts] == [[0], [1]]
    assert not set(parts[0][0]["sample_ids"]) & set(parts[1][0]["sample_ids"])

    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = FeatureDataset(reference), FeatureDataset(features, verify_checksums=True)
    # the shard plan does not depend on the number of processes
    assert [e["sample_ids"] for e in two.shards] == [e["sample_ids"] for e in one.shards]
    position = {sample_id: i for i, sample_id in enumerate(one.sample_ids)}
    for i in range(len(two)):
        a, b = one[position[two.sample_ids[i]]], two[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        # thread counts differ between the runs; allow one bf16 rounding step
        torch.testing.assert_close(a["hidden"].float(), b["hidden"].float(), rtol=1e-2, atol=1e-4)


# ------------------------------------------------------------------------------------------------ encoded storage

PCA = ("data.storage_dtype=pca", "data.storage_fit_tokens=600")  # a third of the fixture's tokens: a real subset


@pytest.fixture(scope="module")
def pca_reference(recipe_path: Path) -> Path:
    """One uninterrupted pca extraction (3.8 bits a value), shared by the tests below."""
    features = recipe_path.parent / "pca-reference"
    run_inprocess(recipe_path, features, *PCA)
    return features


def hidden_of(features: Path) -> dict[int, torch.Tensor]:
    ds = FeatureDataset(features)
    return {ds.sample_ids[i]: ds[i]["hidden"].float() for i in range(len(ds))}


@pytest.mark.parametrize("dtype, bound", [("fp8_e4m3", 0.035), ("pca", 0.1)])
def test_encoded_features_decode_close_to_the_stored_ones(recipe_path, reference, pca_reference, dtype, bound):
    """An encoded extraction holds the same samples as a bf16 one, decoded to float32 within the encoding's error
    (relative RMS per layer), in fewer bytes; its manifest records the encoding."""
    from data.codecs import relative_rms

    features = pca_reference if dtype == "pca" else recipe_path.parent / "fp8-reference"
    if dtype != "pca":
        run_inprocess(recipe_path, features, f"data.storage_dtype={dtype}")
    plain, encoded = hidden_of(reference), hidden_of(features)
    assert plain.keys() == encoded.keys()
    ids = sorted(plain)
    errors = relative_rms(torch.cat([encoded[i] for i in ids]), torch.cat([plain[i] for i in ids]))
    assert max(errors) < bound, errors
    manifest, bf16 = (json.loads((f / MANIFEST).read_text()) for f in (features, reference))
    assert manifest["encoding"]["name"] == manifest["dtype"] == dtype and manifest["format_version"] == 2
    assert [e["sample_ids"] for e in manifest["shards"]] == [e["sample_ids"] for e in bf16["shards"]]
    # d = 64: fp8's float32 scale per layer weighs 4/64 more than bf16's half; pca holds 3.8 of bf16's 16 bits
    assert manifest["hidden_bytes_per_token"] <= bf16["hidden_bytes_per_token"] * (3.8 / 16 if dtype == "pca" else 0.54)
    if dtype == "pca":
        assert manifest["encoding"]["bits"] == [3.8] * 3 and 0 < manifest["encoding"]["fitted_tokens"] <= 700
        assert manifest["encoding"]["basis_sha256"] == file_sha256(features / "basis.safetensors")


def test_pca_killed_then_resumed_equals_uninterrupted(recipe_path, pca_reference, monkeypatch) -> None:
    """Killed after its first shard (the basis already durable), and killed while writing the basis (a torn
    temporary file, or a torn basis under its name), a pca extraction resumes to the same bytes, basis included."""
    features = recipe_path.parent / "pca-resumed"
    monkeypatch.setenv(STOP_AFTER_ENV, "1")
    with pytest.raises(SystemExit):
        run_inprocess(recipe_path, features, *PCA)
    assert sorted(p.name for p in features.glob("*.safetensors")) == ["basis.safetensors", "shard-00000.safetensors"]
    assert not (features / MANIFEST).exists()
    monkeypatch.delenv(STOP_AFTER_ENV)
    run_inprocess(recipe_path, features, *PCA)
    assert encoded_bytes(features) == encoded_bytes(pca_reference)

    for torn in ("basis.safetensors.tmp", "basis.safetensors"):
        shutil.rmtree(features)
        features.mkdir()
        (features / torn).write_bytes((pca_reference / "basis.safetensors").read_bytes()[:1000])
        run_inprocess(recipe_path, features, *PCA)
        assert encoded_bytes(features) == encoded_bytes(pca_reference) and not list(features.glob("*.tmp"))


def encoded_bytes(features: Path) -> dict[str, bytes]:
    return {**shard_bytes(features), "basis": (features / "basis.safetensors").read_bytes()}


def test_a_damaged_basis_is_refused_then_repaired(recipe_path, pca_reference, tmp_path, capfd) -> None:
    """A flipped bit in the basis: training's reader refuses it naming the file; extraction fits it again (the fit
    is deterministic: the same bytes) and keeps every shard."""
    features = tmp_path / "features"
    inodes = copy_features(pca_reference, features)
    basis = features / "basis.safetensors"
    data = bytearray(basis.read_bytes())
    data[-9] ^= 0x01
    basis.write_bytes(bytes(data))
    with pytest.raises(FeatureMismatchError, match=rf"^{re.escape(str(basis))}: sha256 .* foreign basis; re-run"):
        FeatureDataset(features)
    capfd.readouterr()
    run_inprocess(recipe_path, features, *PCA)
    assert f"{basis}: not this extraction's basis or its shards; fitting it again" in capfd.readouterr().err
    assert encoded_bytes(features) == encoded_bytes(pca_reference)
    assert {p.name: p.stat().st_ino for p in features.glob("shard-*.safetensors")} == inodes


def test_a_basis_left_by_another_extraction_is_not_reused(recipe_path, pca_reference, tmp_path, capfd) -> None:
    """A basis in the directory that was fitted for other data (same encoding settings, no shards recorded) is fitted
    again for this extraction's data, not used."""
    features = tmp_path / "features"
    features.mkdir()
    shutil.copy(pca_reference / "basis.safetensors", features)
    capfd.readouterr()
    run_inprocess(recipe_path, features, *PCA, "data.max_samples=20")
    assert "basis.safetensors: not this extraction's basis" in capfd.readouterr().err
    assert (features / "basis.safetensors").read_bytes() != (pca_reference / "basis.safetensors").read_bytes()
    assert len(FeatureDataset(features)) == 20


@pytest.mark.parametrize(
    "overrides, field",
    [
        ((), "dtype"),
        (("data.storage_dtype=fp8_e4m3",), "dtype"),
        ((*PCA, "data.storage_bits=3.0"), "encoding.bits"),
        ((*PCA, "data.storage_bits=[3.8,3.8,6]"), "encoding.bits"),
        (("data.storage_dtype=pca", "data.storage_fit_tokens=900"), "encoding.fit_tokens"),
    ],
)
def test_reuse_with_another_encoding_is_refused(recipe_path, pca_reference, overrides, field) -> None:
    before = encoded_bytes(pca_reference)
    with pytest.raises(FeatureMismatchError, match=rf"built with {re.escape(field)}=.*; use another data.features_dir"):
        run_inprocess(recipe_path, pca_reference, *overrides)
    assert encoded_bytes(pca_reference) == before


@pytest.mark.parametrize("method", ["eagle2", "eagle3"])
def test_training_on_encoded_features_learns_like_on_plain_ones(tmp_path: Path, monkeypatch, method: str) -> None:
    """A tiny recipe trained 30 steps on its float32 features and on fp8 and pca encodings of the same hidden states
    (same seed, same batches): every run trains on the decoded states, and EAGLE-2's loss (feature regression + soft
    CE) stays within 2% of the plain run's. The tiny EAGLE-3's loss counts only positions whose target top-1 is in a
    128-token draft vocabulary, and a random target's near-ties let pca's error move a few of them: fp8 stays within
    2% there, pca only has to train."""
    monkeypatch.chdir(ROOT)  # the tiny recipes name repository-relative files
    tiny = ROOT / f"recipes/tiny/{method}.yaml"
    quiet = ["train.max_steps=30", "train.eval_every=0", "train.save_every=0", "train.log_every=1"]
    mean = {}
    for dtype in ("float32", "fp8_e4m3", "pca"):
        settings = [f"data.features_dir={tmp_path / dtype}", f"data.storage_dtype={dtype}"]
        try:
            main([str(tiny), *settings])
            train_main([str(tiny), *settings, f"train.output_dir={tmp_path / ('run-' + dtype)}", *quiet])
        finally:
            reset_accelerate()
        metrics = (tmp_path / f"run-{dtype}" / "metrics.jsonl").read_text().splitlines()
        losses = [json.loads(line)["train/loss"] for line in metrics if "train/loss" in line]
        assert len(losses) == 30 and all(map(math.isfinite, losses)) and sum(losses) > 0
        mean[dtype] = sum(losses) / len(losses)
        if method == "eagle2":
            assert sum(losses[-10:]) < sum(losses[:10])
    for dtype in ("fp8_e4m3", "pca") if method == "eagle2" else ("fp8_e4m3",):
        assert abs(mean[dtype] - mean["float32"]) < 0.02 * mean["float32"], mean


@pytest.mark.slow
def test_two_processes_share_one_basis_and_write_what_one_does(recipe_path: Path, pca_reference: Path) -> None:
    """Process 0 fits and writes the basis before either process writes a shard; both encode with it: the same
    files as one process (threads aside: compared within pca's own quantization step, and the basis exactly)."""
    features = recipe_path.parent / "pca-two-procs"
    cmd = accelerate_launch("--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                            "--dynamo_backend", "no", "-m", "data.extract", str(recipe_path),
                            f"data.features_dir={features}", *PCA)  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = (json.loads((f / MANIFEST).read_text()) for f in (pca_reference, features))
    assert one["encoding"] == two["encoding"] and [e["sample_ids"] for e in one["shards"]] == [
        e["sample_ids"] for e in two["shards"]
    ]
    a, b = hidden_of(pca_reference), hidden_of(features)
    for i in a:
        torch.testing.assert_close(a[i], b[i], rtol=0, atol=1e-3 * float(a[i].abs().max()))


def test_vllm_hidden_states_are_assembled_per_input_from_the_captured_forwards() -> None:
    """`--engine vllm` (data/engines.py) captures flattened forwards: prompts split where positions restart at 0 and
    matched to their inputs by token ids, in any order and over several forwards; a chunked prompt is refused.
    (The states themselves are compared with transformers' by `make check-vllm-extract`: CI has no vLLM.)"""
    from data.engine_worker import EngineError, _assemble

    inputs = [[5, 6, 7], [9, 9], [5, 6, 7], [4]]
    states = {tuple(ids): torch.randn(len(ids), 2, 3) for ids in inputs}  # (tokens, 2 indices, d)

    def step(*prompts):
        ids = [t for p in prompts for t in p]
        layered = torch.cat([states.get(tuple(p), torch.zeros(len(p), 2, 3)) for p in prompts])
        return {"ids": torch.tensor(ids), "positions": torch.cat([torch.arange(len(p)) for p in prompts]),
                0: layered[:, 0], 3: layered[:, 1]}  # fmt: skip

    found = _assemble([step([9, 9], [5, 6, 7]), step([4], [5, 6, 7])], inputs, [0, 3])
    assert [h.shape[0] for h in found] == [3, 2, 3, 1]
    for ids, h in zip(inputs, found):
        assert torch.equal(h, states[tuple(ids)])
    chunked = {
        "ids": torch.tensor([6, 7]),
        "positions": torch.tensor([1, 2]),
        0: torch.zeros(2, 3),
        3: torch.zeros(2, 3),
    }
    with pytest.raises(EngineError, match="starts inside a prompt"):
        _assemble([step([9, 9], [5, 6, 7], [4]), chunked], inputs, [0, 3])
    with pytest.raises(EngineError, match="1 of the 4 inputs out of sight"):
        _assemble([step([9, 9], [5, 6, 7], [4])], inputs, [0, 3])
    with pytest.raises(EngineError, match="no whole input"):
        _assemble([step([9, 9], [5, 6])], [[9, 9], [5, 6, 7]], [0, 3])


def test_engine_vllm_refuses_what_it_cannot_run(recipe_path: Path, tmp_path: Path) -> None:
    """A random target, a device map, engine options without the engine, and a Python without vLLM: one line each,
    before any feature is written."""
    recipe = load_recipe(recipe_path)
    load_target(**vars(recipe.target)).model.save_pretrained(tmp_path / "model")
    on_path = ["target.random_init=", f"target.path={tmp_path / 'model'}"]
    with pytest.raises(RecipeError, match="target.path: --engine vllm runs a target directory"):
        run_inprocess(recipe_path, tmp_path / "a", "--engine", "vllm")
    with pytest.raises(RecipeError, match="target.device_map: is for --engine hf"):
        run_inprocess(recipe_path, tmp_path / "b", *on_path, "target.device_map=auto", "--engine", "vllm")
    with pytest.raises(SystemExit):
        run_inprocess(recipe_path, tmp_path / "c", "--engine-args", '{"max_num_seqs": 4}')
    with pytest.raises(ExtractError, match=r"--engine vllm: no vLLM in .*make vllm-env"):
        run_inprocess(recipe_path, tmp_path / "d", *on_path, "--engine", "vllm", "--engine-python", sys.executable)
    assert not list((tmp_path / "d").glob("shard-*"))


def test_features_vllm_extracted_are_not_extended_by_transformers(recipe_path: Path, reference: Path, tmp_path) -> None:
    """The manifest of a vLLM extraction says `engine: vllm`; the transformers path refuses to re-run over it (and
    its own manifests hold no `engine`, as before the option)."""
    assert "engine" not in json.loads((reference / MANIFEST).read_text())
    features = tmp_path / "features"
    shutil.copytree(reference, features)
    manifest = json.loads((features / MANIFEST).read_text())
    (features / MANIFEST).write_text(json.dumps({**manifest, "engine": "vllm"}))
    with pytest.raises(FeatureMismatchError, match="built with engine="):
        run_inprocess(recipe_path, features)


def test_a_target_cut_into_pieces_extracts_the_whole_targets_features(recipe_path: Path, tmp_path: Path) -> None:
    """`target.device_map` in extraction: a target whose layers run in pieces (every other one offloaded to disk,
    brought in by accelerate's hooks for each forward) writes the shards and manifest of the whole target, byte for
    byte; its identity comes from the checkpoint, its offloaded weights being on the meta device."""
    from tiny import cut_map

    recipe = load_recipe(recipe_path)
    load_target(**vars(recipe.target)).model.save_pretrained(tmp_path / "model")
    on_path = ["target.random_init=", f"target.path={tmp_path / 'model'}"]
    run_inprocess(recipe_path, tmp_path / "whole", *on_path)
    placed = [f"target.device_map={json.dumps(cut_map(3))}", f"target.offload_folder={tmp_path / 'offload'}"]
    run_inprocess(recipe_path, tmp_path / "cut", *on_path, *placed)
    assert shard_bytes(tmp_path / "cut") == shard_bytes(tmp_path / "whole")
    cut = load_target(path=str(tmp_path / "model"), dtype="float32", device_map=cut_map(3),
                      offload_folder=str(tmp_path / "offload"))  # fmt: skip
    assert cut.offloaded() and cut.base.layers[1].self_attn.q_proj.weight.device.type == "meta"


def test_scratch_of_a_killed_vllm_extraction_is_removed(tmp_path: Path) -> None:
    """A vLLM extraction killed mid-batch leaves its scratch directory (in /dev/shm: memory); the next one removes
    the directories of processes that are gone, and keeps those of live ones."""
    from data.vllm_features import SCRATCH_PREFIX, _remove_stale_scratch

    dead = 99_999_999  # above the largest process id Linux hands out (2**22)
    assert not Path(f"/proc/{dead}").exists()
    gone = tmp_path / f"{SCRATCH_PREFIX}{dead}-abc"
    live = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-def"
    for path in (gone, live):
        path.mkdir()
        (path / "hidden.f32").write_bytes(b"\0" * 64)
    _remove_stale_scratch(str(tmp_path))
    assert not gone.exists() and live.exists()
