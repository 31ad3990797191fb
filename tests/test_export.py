"""Export -> reload round trips: `pytest tests/test_export.py`.

Tiny drafters are trained for two steps on the tiny recipes, exported with `python -m export`
and rebuilt with `models.io.load_drafter` (what eval uses): outputs must be identical.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import reset_accelerate

from data.extract import main as extract_main
from data.heldout import read_heldout
from data.loader import BatchLoader
from data.shards import FeatureDataset
from data.vocab_counts import frequent_loss_tokens
from eval import EvalError
from eval.calibration import draft_vocabulary
from export.gate_parts import ENGINE_WEIGHTS, MEDUSA_PT
from export.gate_parts import MEDUSA_SAFETENSORS as MEDUSA_WEIGHTS
from export.write import export, load_run
from export.write import main as export_main
from methods import METHODS
from methods.medusa1.layouts import medusa_names
from models.io import (
    CONFIG_FILE,
    EXPORT_MARKER,
    WEIGHTS_FILE,
    ExportError,
    legacy_rope,
    load_draft_vocab,
    load_drafter,
    read_config,
    save_native,
)
from models.target import load_target
from schema.recipe import load_recipe
from train.loop import train

pytestmark = pytest.mark.usefixtures("at_root")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two-step runs of both tiny recipes on shared features."""
    root = tmp_path_factory.mktemp("export")
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    features = root / "features"
    extract_main(["recipes/tiny/eagle2.yaml", f"data.features_dir={features}"])
    out = {}
    plain = ["drafter.fc_norm=false", "drafter.post_norm=false"]  # EAGLE-1/2 as upstream: engine layouts
    for name, method, extra in [
        ("eagle2", "eagle2", []),
        ("medusa1", "medusa1", []),
        ("medusa1-shared", "medusa1", ["drafter.share_lm_head=true"]),
        ("medusa5", "medusa1", ["drafter.num_heads=5"]),  # FasterDecoding's loader builds 5 heads
        ("medusa5-shared", "medusa1", ["drafter.num_heads=5", "drafter.share_lm_head=true"]),
        ("medusa5-2layers", "medusa1", ["drafter.num_heads=5", "drafter.num_layers=2"]),
        ("eagle2-plain", "eagle2", plain),
        ("eagle2-vllm", "eagle2", [*plain, "drafter.fc_bias=false"]),  # vLLM's EAGLE fc has no bias
        ("eagle2-vocab", "eagle2", ["eval.draft_vocab=16"]),
    ]:
        reset_accelerate()
        out[name] = root / name
        overrides = [f"data.features_dir={features}", f"train.output_dir={out[name]}", "train.max_steps=2", *extra]
        train(load_recipe(f"recipes/tiny/{method}.yaml", overrides))
    reset_accelerate()
    yield out
    mp.undo()


def a_batch(run: Path) -> dict:
    recipe = load_recipe(run / "recipe.yaml")
    return next(BatchLoader(FeatureDataset(recipe.data.features_dir), batch_size=4, shuffle=False).batches())


@pytest.mark.parametrize("method", ["eagle2", "medusa1"])
def test_native_round_trip_gives_identical_outputs(method, runs, tmp_path):
    out = export(runs[method], tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, CONFIG_FILE, WEIGHTS_FILE]  # no pickle anywhere
    _, target, trained = load_run(runs[method])
    reloaded = load_drafter(out, target)
    assert type(reloaded) is type(trained) and not reloaded.training
    batch = a_batch(runs[method])
    with torch.no_grad():
        want, got = trained(batch), reloaded(batch)
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), key
        hidden = batch["hidden"][:, :, 0]  # (B, T, d): the last hidden state
        if method == "medusa1":
            assert torch.equal(trained.head_logits(hidden), reloaded.head_logits(hidden))
        else:
            assert torch.equal(
                trained.logits(trained.predict_features(batch)), reloaded.logits(reloaded.predict_features(batch))
            )


def test_config_and_tensors(runs, tmp_path):
    out = export(runs["eagle2"], tmp_path / "export")
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["method"] == "eagle2" and config["stored_layers"] == [-1]
    assert config["drafter"]["feature_layers"] == [-1] and config["target"]["num_layers"] == 2
    assert config["recipe"]["train"]["max_steps"] == 2
    _, _, trained = load_run(runs["eagle2"])
    tensors = load_file(str(out / WEIGHTS_FILE))
    assert tensors.keys() == trained.trainable_state_dict().keys()
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in tensors)


def test_include_target_weights(runs, tmp_path):
    out = export(runs["eagle2"], tmp_path / "export", include_target_weights=True)
    tensors = load_file(str(out / WEIGHTS_FILE))
    assert {"embed_tokens.weight", "lm_head.weight"} <= tensors.keys()
    _, target, _ = load_run(runs["eagle2"])
    load_drafter(out, target)  # frozen tensors equal to the target's are accepted


def test_target_weights_of_a_bf16_export_reload_onto_the_target_in_float32(tmp_path):
    """An export carrying the target's tensors, written from a bf16 target, loads onto the same target in float32
    (compared in bf16); onto another target it is refused."""
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    bf16 = load_target(random_init=config, dtype="bfloat16")
    recipe = load_recipe(ROOT / "recipes/tiny/eagle2.yaml")
    drafter = METHODS["eagle2"].module()(recipe.drafter, bf16.parts([-1])).eval()
    out = save_native(tmp_path / "export", drafter, bf16, include_target_weights=True)
    load_drafter(out, load_target(random_init=config, dtype="float32"))
    with pytest.raises(ExportError, match="embed_tokens.weight is a frozen target tensor and differs"):
        load_drafter(out, load_target(random_init=config, dtype="float32", seed=1))


def test_an_export_binds_its_targets_whole_weights_tokenizer_and_chat_template(runs, tmp_path):
    """The target identity an export records hashes every byte of every tensor (a change past the elements the older
    fingerprint sampled is caught) and the tokenizer's vocabulary and chat template; loading onto another is one line
    naming the field. An identity recorded before (sampled weights, no tokenizer) still loads."""
    out = export(runs["eagle2"], tmp_path / "export")
    recorded = json.loads((out / CONFIG_FILE).read_text())
    assert "weights_sha256_whole" in recorded["target"] and recorded["tokenizer"].keys() == {"vocab_sha256",
        "chat_template_sha256"}  # fmt: skip
    _, target, _ = load_run(runs["eagle2"])
    load_drafter(out, target)
    weight = target.model.model.layers[0].mlp.down_proj.weight
    kept = weight.detach().clone()
    with torch.no_grad():
        weight.view(-1)[-1] += 1.0  # far past the first elements the sampled fingerprint reads
    target._whole = None
    with pytest.raises(ExportError, match=r"target.weights_sha256_whole: drafter trained for"):
        load_drafter(out, target)
    with torch.no_grad():
        weight.copy_(kept)
    target._whole = None
    load_drafter(out, target)
    original = target.tokenizer.chat_template
    target.tokenizer.chat_template = (original or "") + "{# another template #}"
    try:
        with pytest.raises(ExportError, match=r"config.json: tokenizer.chat_template_sha256: drafter trained for"):
            load_drafter(out, target)
    finally:
        target.tokenizer.chat_template = original
    (out / EXPORT_MARKER).unlink()  # an export written before whole hashes and tokenizers were recorded
    config = json.loads((out / CONFIG_FILE).read_text())
    del config["target"]["weights_sha256_whole"], config["tokenizer"]
    (out / CONFIG_FILE).write_text(json.dumps(config))
    load_drafter(out, target)


def test_tied_target_weights_export_and_reload(tmp_path):
    """A target with tied embeddings (Qwen2.5 <= 3B, Llama-3.2) has one tensor for embed_tokens and lm_head;
    the export writes both names (safetensors refuses shared memory, so as copies) and reloads."""
    config = {
        "model_type": "qwen2",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }
    target = load_target(random_init=config, dtype="float32")  # fmt: skip
    assert target.embed_tokens.weight.data_ptr() == target.lm_head.weight.data_ptr()
    recipe = load_recipe(ROOT / "recipes/tiny/eagle2.yaml")
    drafter = METHODS["eagle2"].module()(recipe.drafter, target.parts([-1])).eval()
    out = save_native(tmp_path / "export", drafter, target, include_target_weights=True)
    tensors = load_file(str(out / WEIGHTS_FILE))
    assert torch.equal(tensors["embed_tokens.weight"], tensors["lm_head.weight"])
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]  # no temporary file left
    load_drafter(out, target)


def test_strict_loading(runs, tmp_path):
    out = export(runs["medusa1"], tmp_path / "export")
    (out / EXPORT_MARKER).unlink()  # the checks behind the checksums: files no marker lists (an older export)
    recipe, target, _ = load_run(runs["medusa1"])
    tensors = load_file(str(out / WEIGHTS_FILE))

    missing = dict(tensors)
    missing.pop(next(iter(missing)))
    save_file(missing, str(out / WEIGHTS_FILE))
    with pytest.raises(ExportError, match="missing tensors"):
        load_drafter(out, target)

    save_file({**tensors, "blocks.9.layers.0.weight": torch.zeros(1)}, str(out / WEIGHTS_FILE))
    with pytest.raises(ExportError, match="unexpected"):
        load_drafter(out, target)

    save_file(tensors, str(out / WEIGHTS_FILE))
    other = load_target(**{**vars(recipe.target), "seed": 1})
    with pytest.raises(ExportError, match="target.weights_sha256"):
        load_drafter(out, other)


def test_cli(runs, tmp_path, capsys):
    export_main([str(runs["medusa1"]), "--out", str(tmp_path / "cli")])
    assert "exported" in capsys.readouterr().out
    assert (tmp_path / "cli" / WEIGHTS_FILE).is_file()
    with pytest.raises(SystemExit, match="a native export; give --format"):  # a native export is no run
        export_main([str(tmp_path / "cli"), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="no such recipe file"):
        export_main([str(tmp_path), "--out", str(tmp_path / "x")])


@pytest.mark.parametrize("run,fmt", [("eagle2-vllm", "vllm"), ("medusa1", "vllm"), ("eagle2-plain", "sglang")])
def test_a_native_export_exports_to_an_engine_format_as_its_run_does(run, fmt, runs, tmp_path):
    """A native export (a shipped drafter is one) is a source for engine formats: the drafter and the recipe its
    config.json records give the same files as exporting the run, through the same gate; --out is required (the
    default would write inside the export), and native-to-native is refused."""
    native = export(runs[run], tmp_path / "native")
    from_native = export(native, tmp_path / "from-native", fmt=fmt)
    from_run = export(runs[run], tmp_path / "from-run", fmt=fmt)
    files = sorted(p.name for p in from_run.iterdir())
    assert sorted(p.name for p in from_native.iterdir()) == files
    for name in files:
        assert (from_native / name).read_bytes() == (from_run / name).read_bytes(), name
    for args in ({"fmt": fmt}, {"out": tmp_path / "x", "fmt": "native"}, {"out": tmp_path / "x"}):
        with pytest.raises(ExportError, match="a native export; give --format"):
            export(native, **args)
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------------------------
# Engine formats: export, read back into our modules with the inverse key map, identical outputs


def test_medusa_format_round_trip(runs, tmp_path):
    out = export(runs["medusa5"], tmp_path / "medusa", fmt="medusa")
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "config.json", MEDUSA_PT, MEDUSA_WEIGHTS]
    config = json.loads((out / "config.json").read_text())
    assert config["medusa_num_heads"] == 5 and config["medusa_num_layers"] == 1
    assert config["base_model_name_or_path"] == "random_init:llama"
    recipe, target, trained = load_run(runs["medusa5"])
    theirs = load_file(str(out / MEDUSA_WEIGHTS))
    assert sorted(theirs) == sorted(
        f"{h}.{k}" for h in range(5) for k in ("0.linear.weight", "0.linear.bias", "1.weight")
    )
    pt = torch.load(out / MEDUSA_PT, weights_only=True)  # what FasterDecoding's loader reads: tensors only
    assert type(pt) is dict and pt.keys() == theirs.keys() and all(torch.equal(pt[k], theirs[k]) for k in pt)
    fresh = METHODS["medusa1"].module()(recipe.drafter, target.parts(recipe.data.layers)).eval()
    fresh.load_state_dict({ours: theirs[name] for ours, name in medusa_names(fresh).items()}, strict=False)
    hidden = a_batch(runs["medusa5"])["hidden"][:, :, 0]
    with torch.no_grad():
        assert torch.equal(fresh.head_logits(hidden), trained.head_logits(hidden))


def test_medusa_format_with_a_shared_lm_head(runs, tmp_path):
    """share_lm_head heads: FasterDecoding Medusa has no shared projection, so every head gets the target's."""
    out = export(runs["medusa5-shared"], tmp_path / "medusa", fmt="medusa")
    _, target, _ = load_run(runs["medusa5-shared"])
    theirs = load_file(str(out / MEDUSA_WEIGHTS))
    for h in range(5):
        assert torch.equal(theirs[f"{h}.1.weight"], target.lm_head.weight.detach())


def test_medusa_format_refuses_what_fasterdecoding_cannot_hold(runs, tmp_path):
    with pytest.raises(ExportError, match=r"^drafter.num_heads: FasterDecoding .* builds 5 heads") as err:
        export(runs["medusa1"], tmp_path / "a", fmt="medusa")
    assert "\n" not in str(err.value)
    with pytest.raises(ExportError, match=r"^drafter.num_layers: .* shares one ResBlock"):
        export(runs["medusa5-2layers"], tmp_path / "b", fmt="medusa")
    assert not list(tmp_path.iterdir())
    out = export(runs["medusa5-2layers"], tmp_path / "vllm", fmt="vllm")  # vLLM's blocks are separate: it holds them
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def vllm_medusa_logits(out: Path, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's MedusaModel semantics, written from its config keys alone: per head, `num_hidden_layers` residual
    blocks x + SiLU(W x [+ b]) (bias only with `medusa_fc_bias`), then `lm_heads.{h}` (`lm_heads.0`, the original
    lm_head, for every head with `original_lm_head`) -> (K, ..., V)."""
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / ENGINE_WEIGHTS))
    logits = []
    for h in range(config["num_heads"]):
        x = hidden
        for layer in range(config["num_hidden_layers"]):
            bias = tensors[f"blocks.{h}.layers.{layer}.bias"] if config.get("medusa_fc_bias", False) else None
            x = x + torch.nn.functional.silu(
                torch.nn.functional.linear(x, tensors[f"blocks.{h}.layers.{layer}.weight"], bias)
            )
        head = 0 if config.get("original_lm_head", False) else h
        logits.append(x @ tensors[f"lm_heads.{head}.weight"].T)
    return torch.stack(logits)


@pytest.mark.parametrize("run", ["medusa1", "medusa1-shared"])
def test_vllm_medusa_format_computes_the_same_heads(run, runs, tmp_path):
    out = export(runs[run], tmp_path / "vllm", fmt="vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert config["num_heads"] == 3 and config["num_hidden_layers"] == 1 and config["medusa_fc_bias"] is True
    assert config["vocab_size"] == config["truncated_vocab_size"] == 8192 and config["hidden_size"] == 64
    assert config["original_lm_head"] is (run == "medusa1-shared")
    heads = {f"lm_heads.{h}.weight" for h in (range(1) if run == "medusa1-shared" else range(3))}
    blocks = {f"blocks.{h}.layers.0.{k}" for h in range(3) for k in ("weight", "bias")}
    assert set(load_file(str(out / ENGINE_WEIGHTS))) == heads | blocks
    _, _, trained = load_run(runs[run])
    hidden = a_batch(runs[run])["hidden"][:, :, 0].float()
    with torch.no_grad():
        torch.testing.assert_close(vllm_medusa_logits(out, hidden), trained.head_logits(hidden), rtol=1e-5, atol=1e-5)


def test_vllm_format_writes_eagle_drafters_in_the_safeailab_layout(runs, tmp_path):
    vllm, eagle = (
        export(runs["eagle2-vllm"], tmp_path / "vllm", fmt="vllm"),
        export(runs["eagle2-vllm"], tmp_path / "eagle", fmt="eagle"),
    )
    config = json.loads((vllm / "config.json").read_text())
    assert config == json.loads((eagle / "config.json").read_text()) and config["bias"] is False
    assert (vllm / ENGINE_WEIGHTS).read_bytes() == (eagle / ENGINE_WEIGHTS).read_bytes()
    assert "fc.bias" not in load_file(str(vllm / ENGINE_WEIGHTS))


@pytest.mark.parametrize("fmt,arch", [("eagle", "LlamaForCausalLM"), ("sglang", "LlamaForCausalLMEagle")])
def test_eagle_formats_round_trip(fmt, arch, runs, tmp_path):
    out = export(runs["eagle2-plain"], tmp_path / fmt, fmt=fmt)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch] and config["num_hidden_layers"] == 1
    assert config.get("bias") is (True if fmt == "eagle" else None)  # SGLang would read `bias` as attention biases
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]  # transformers-4 consumers read this
    assert config["hidden_size"] == 64 and config["vocab_size"] == 8192
    theirs = load_file(str(out / ENGINE_WEIGHTS))
    assert {
        "fc.weight",
        "fc.bias",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.post_attention_layernorm.weight",
    } <= set(theirs)
    assert not any("input_layernorm" in k or k.startswith(("norm.", "fc_norm", "embed_tokens")) for k in theirs)
    assert theirs["fc.weight"].shape == (64, 128)  # cat(embedding(x_{t+1}), f_t) -> d
    if fmt == "eagle":  # SafeAILab's PyPI release reads only pytorch_model.bin: the same tensors, tensors only
        pt = torch.load(out / "pytorch_model.bin", weights_only=True)
        assert type(pt) is dict and pt.keys() == theirs.keys() and all(torch.equal(pt[k], theirs[k]) for k in pt)
    else:
        assert not (out / "pytorch_model.bin").exists()
    recipe, target, trained = load_run(runs["eagle2-plain"])
    fresh = METHODS["eagle2"].module()(recipe.drafter, target.parts(recipe.data.layers)).eval()
    missing, unexpected = fresh.load_state_dict(theirs, strict=False)
    assert not unexpected and not missing  # the target's embedding and lm_head are borrowed, not registered
    batch = a_batch(runs["eagle2-plain"])
    with torch.no_grad():
        assert torch.equal(fresh.logits(fresh.predict_features(batch)), trained.logits(trained.predict_features(batch)))


def test_sglang_gets_a_zero_fc_bias_and_every_eagle_layout_the_legacy_rope_fields(runs, tmp_path):
    out = export(runs["eagle2-vllm"], tmp_path / "sglang", fmt="sglang")  # a drafter trained without fc bias
    theirs = load_file(str(out / ENGINE_WEIGHTS))
    assert torch.equal(theirs["fc.bias"], torch.zeros(theirs["fc.weight"].shape[0], dtype=theirs["fc.weight"].dtype))
    assert "bias" not in json.loads((out / "config.json").read_text())
    scaled = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}  # fmt: skip
    legacy = legacy_rope({"rope_parameters": scaled})
    assert legacy["rope_theta"] == 500000.0 and legacy["rope_scaling"]["type"] == "llama3"
    assert legacy["rope_scaling"]["factor"] == 8.0 and "rope_theta" not in legacy["rope_scaling"]
    assert legacy_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}) == {"rope_theta": 1e4}


def test_engine_formats_refuse_what_they_cannot_hold(runs, tmp_path):
    with pytest.raises(ExportError, match="no FC-Norm, post-norm"):
        export(runs["eagle2"], tmp_path / "a", fmt="eagle")
    with pytest.raises(ExportError, match="medusa cannot hold a eagle2 drafter"):
        export(runs["eagle2"], tmp_path / "b", fmt="medusa")
    with pytest.raises(ExportError, match="sglang cannot hold a medusa1 drafter"):
        export(runs["medusa1"], tmp_path / "c", fmt="sglang")
    with pytest.raises(ExportError, match="drafter.fc_bias=false"):  # vLLM would drop fc.bias without a word
        export(runs["eagle2-plain"], tmp_path / "d", fmt="vllm")
    # a drafter no EAGLE-1/2 layout holds hears that first, not advice to export to layouts that refuse it too
    with pytest.raises(ExportError, match="no FC-Norm, post-norm or feature fusion; .* or export --format native$"):
        export(runs["eagle2"], tmp_path / "e", fmt="vllm")
    assert not list(tmp_path.iterdir())  # a refused export leaves nothing, not even its temporary directory


def test_each_format_has_its_own_directory_and_a_re_export_replaces_it(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["eagle2-vllm"], run)
    vllm = export(run, fmt="vllm")
    with pytest.raises(ExportError) as info:  # evaluation reads the native export: the error says how to write it
        read_config(run / "export")
    assert str(info.value) == (
        f"{run / 'export'}: no such drafter export directory; beside it only engine layouts (export-vllm): write the "
        f"native one with `python -m export {run} --format native`"
    )
    native = export(run)
    assert (native, vllm) == (run / "export", run / "export-vllm")
    assert json.loads((native / "config.json").read_text())["format"] != json.loads(
        (vllm / "config.json").read_text()
    ).get("format")
    (native / "stale.txt").write_text("from the earlier export")  # a file the earlier export wrote, this one does not
    marker = json.loads((native / EXPORT_MARKER).read_text())
    marker["files"]["stale.txt"] = "0" * 64
    (native / EXPORT_MARKER).write_text(json.dumps(marker))
    assert export(run) == native and not (native / "stale.txt").exists()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    with pytest.raises(ExportError, match=f"^{other}: holds files no export wrote"):
        export(run, other)
    assert (other / "todo.txt").read_text() == "mine"


def test_an_export_replaces_only_what_an_export_wrote(runs, tmp_path):
    """A model directory (config.json and weights, no marker), a user's `<out>.tmp`, a symbolic link or a file at
    --out are refused before anything is written or deleted; an export, or a native one from before the marker
    existed, is replaced."""
    run = runs["eagle2"]
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ExportError, match=f"^{model}: holds files no export wrote"):
        export(run, model, fmt="vllm")
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]
    out = tmp_path / "out"
    (tmp_path / "out.tmp").mkdir()
    (tmp_path / "out.tmp" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"out\.tmp: holds files no export wrote"):
        export(run, out)
    assert (tmp_path / "out.tmp" / "notes.txt").read_text() == "mine" and not out.exists()
    shutil.rmtree(tmp_path / "out.tmp")
    first = export(run, out)
    (tmp_path / "link").symlink_to(first)
    with pytest.raises(ExportError, match="link: is a symbolic link"):
        export(run, tmp_path / "link")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="file: is a file"):
        export(run, tmp_path / "file")
    (first / EXPORT_MARKER).unlink()  # a native export written before the marker existed: its config says so
    assert export(run, out) == out and (out / EXPORT_MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "link", "my-model", "out"]  # nothing staged left


def test_an_export_beside_a_users_files_is_refused_and_keeps_them(runs, tmp_path):
    """An export's marker lists the files it wrote: a directory holding anything else too (a user's notes, a
    subdirectory) is refused, naming it, and nothing is deleted; without them the export is replaced."""
    out = export(runs["eagle2"], tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    (out / "plots").mkdir()
    (out / "plots" / "loss.png").write_bytes(b"png")
    with pytest.raises(ExportError, match=rf"^{out}: holds notes.txt and 1 more, which no export wrote, beside"):
        export(runs["eagle2"], out)
    assert (out / "notes.txt").read_text() == "mine" and (out / "plots" / "loss.png").is_file()
    (out / "notes.txt").unlink()
    shutil.rmtree(out / "plots")
    assert export(runs["eagle2"], out) == out


@pytest.mark.parametrize("victim", [WEIGHTS_FILE, CONFIG_FILE, "draft_vocab.safetensors"])
def test_an_export_whose_bytes_changed_is_refused_naming_the_file(runs, tmp_path, victim):
    """The marker records every file's sha256; loading checks them: one flipped byte anywhere is one line naming the
    file, and so is a missing file."""
    out = export(runs["eagle2-vocab"], tmp_path / "export")
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert set(marker["files"]) == {CONFIG_FILE, WEIGHTS_FILE, "draft_vocab.safetensors"}
    recipe, target, _ = load_run(runs["eagle2-vocab"])
    load_drafter(out, target)  # as written: loads
    raw = bytearray((out / victim).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (out / victim).write_bytes(bytes(raw))
    with pytest.raises(ExportError, match=rf"^{out / victim}: its bytes are not those {out / EXPORT_MARKER} records"):
        load_drafter(out, target)
    (out / victim).unlink()
    with pytest.raises(ExportError, match=rf"^{out / victim}: missing, though {out / EXPORT_MARKER} lists it"):
        load_drafter(out, target)


def test_a_second_export_into_the_same_directory_is_refused(runs, tmp_path):
    """While another export writes --out (here: this test holds its lock, beside --out since --out is replaced whole),
    an export into it is refused before anything is staged, naming it and the holder; once free, it exports, and
    no lock file stays behind."""
    from rundir.lock import DirectoryLocked, acquire, release

    out = tmp_path / "out"
    held = acquire(out, "export", beside=True)
    try:
        holder = rf"another export is writing there \(pid {os.getpid()}:"
        with pytest.raises(DirectoryLocked, match=rf"^--out: {out}: {holder}"):
            export(runs["eagle2"], out)
        assert not out.exists() and not (tmp_path / "out.tmp").exists()
    finally:
        release(held)
    assert export(runs["eagle2"], out) == out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_native_export_carries_the_draft_vocabulary(runs, tmp_path):
    """eval.draft_vocab: the export ships the data's most frequent loss tokens, so evaluation needs no shards."""
    out = export(runs["eagle2-vocab"], tmp_path / "export")
    recipe = load_recipe(runs["eagle2-vocab"] / "recipe.yaml")
    heldout = read_heldout(runs["eagle2-vocab"])
    assert heldout  # counted without the held-out samples, as training chose its loss tokens
    counted = frequent_loss_tokens(FeatureDataset(recipe.data.features_dir), 16, skip_ids=heldout)
    assert torch.equal(load_draft_vocab(out), counted)
    no_shards = load_recipe(runs["eagle2-vocab"] / "recipe.yaml", [f"data.features_dir={tmp_path / 'none'}"])
    assert torch.equal(draft_vocabulary(no_shards, str(out), 8), counted[:8])
    assert torch.equal(draft_vocabulary(no_shards, str(out), 32), counted)  # all the data's tokens it has
    (out / "draft_vocab.safetensors").unlink()
    with pytest.raises(EvalError, match="No feature shards at data.features_dir"):
        draft_vocabulary(no_shards, str(out), 32)
    assert load_draft_vocab(export(runs["eagle2"], tmp_path / "plain")) is None  # drafts over the whole vocabulary


def test_exports_and_shards_are_readable_as_any_new_file(runs, tmp_path):
    """safetensors creates its files readable by their owner only; a serving engine running as another user must
    be able to read an export, so every file gets the mode the umask gives any new file (0644 under 022)."""
    (tmp_path / "probe").write_text("")
    expected = stat.S_IMODE((tmp_path / "probe").stat().st_mode)
    native = export(runs["eagle2-vocab"], tmp_path / "native")
    sglang = export(runs["eagle2-plain"], tmp_path / "sglang", fmt="sglang")
    features = runs["eagle2"].parent / "features"
    files = [f for d in (native, sglang, features, runs["eagle2"]) for f in d.rglob("*.safetensors")]
    assert {f.parent.name for f in files} >= {"native", "sglang", "features"} and any("step-" in str(f) for f in files)
    assert {str(f): oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {str(f): oct(expected) for f in files}
