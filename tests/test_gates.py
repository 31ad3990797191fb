"""Load gates (`export.gates`): good exports pass; exports a consumer loads wrong fail with one line naming the field.

Drafters here are built untrained on tiny random targets and perturbed (no training needed to check a layout), then
written with `export.write`'s writers and handed to `export.gates.check`.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import perturbed

from export import write as export_mod
from export.gate_parts import EAGLE_PT, MEDUSA_PT, rope_cos_sin
from export.gates import check, gate
from methods import METHODS, resolve
from methods.eagle2 import layouts as eagle_layouts
from methods.eagle2.config import EagleConfig
from methods.eagle2.model import EagleDrafter
from methods.medusa1 import layouts as medusa_layouts
from methods.medusa1.config import MedusaConfig
from methods.medusa1.model import MedusaHeads
from models.io import EXPORT_MARKER, ExportError
from models.target import load_target
from schema.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip


def tiny_target(rope: dict | None = None, **fields):
    config = dict(TINY, rope_parameters=rope, **fields) if rope else TINY
    return load_target(random_init=config, dtype="float32")


@pytest.fixture(scope="module")
def targets():
    return {
        "plain": tiny_target(),
        "theta": tiny_target({"rope_type": "default", "rope_theta": 500000.0}),
        "llama3": tiny_target(LLAMA3),
        "linear": tiny_target({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        "linear-theta": tiny_target({"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}),
        # NTK scaling that grows the base within the gate's sequences (longer than 8 positions)
        "dynamic": tiny_target(
            {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}, max_position_embeddings=8
        ),
        "biased": load_target(random_init=dict(TINY, attention_bias=True), dtype="float32"),
        "bf16": load_target(random_init=TINY, dtype="bfloat16"),  # float32 drafters project through a bf16 lm_head
    }


@pytest.fixture(scope="module")
def recipes():
    return {
        "medusa": load_recipe(ROOT / "recipes/tiny/medusa1.yaml"),
        "eagle": load_recipe(ROOT / "recipes/tiny/eagle2.yaml", ["drafter.fc_norm=false", "drafter.post_norm=false"]),
    }


@pytest.fixture
def recipe(recipes, request):
    """The tiny recipe of the test's method (writers and gates read its method, not its fields)."""
    return recipes["medusa" if "medusa" in request.node.name else "eagle"]


def eagle(target, **cfg) -> EagleDrafter:
    config = EagleConfig(fc_norm=False, post_norm=False, **cfg)
    return perturbed(EagleDrafter(config, target.parts([-1])))


def medusa(target, **cfg) -> MedusaHeads:
    return perturbed(MedusaHeads(MedusaConfig(**cfg), target.parts([-1])))


def write(fmt: str, out: Path, recipe, target, drafter, include_target_weights: bool = False) -> Path:
    out.mkdir()
    if fmt == "medusa":  # past the writer's refusal of heads FasterDecoding cannot hold: the gate is under test
        medusa_layouts.write_medusa_files(out, recipe, target, drafter)
    else:  # the writer the drafter's method declares for the format
        resolve(METHODS[drafter.cfg.method].formats[fmt].writer)(out, recipe, target, drafter, include_target_weights)
    return out


def one_line_error(match: str, *args) -> str:
    with pytest.raises(ExportError, match=match) as err:
        check(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_every_format_of_every_method_has_a_writer_and_a_gate():
    """The export registries are the methods' declarations (`methods`): every format a method declares
    resolves to its gate and, but for native (the project's own writer), to its writer; `methods.FORMATS` is
    their union and the recipe schema knows each."""
    for method in METHODS.values():
        assert method.formats["native"].writer is None, method.name
        for fmt, layout in method.formats.items():
            assert callable(resolve(layout.gate)) and gate(fmt, method.name) is resolve(layout.gate)
            assert fmt == "native" or callable(resolve(layout.writer)), (method.name, fmt)
            assert load_recipe(ROOT / "recipes/tiny/eagle2.yaml", [f"export.format={fmt}"]).export.format == fmt
    assert set(export_mod.FORMATS) == {fmt for method in METHODS.values() for fmt in method.formats}


def test_export_never_asks_which_method_it_has():
    """Nothing in export/ compares a method's name or kind: what a method's export is, its entry declares (a
    comparison such as `cfg.method == "peagle"` or `method.proposer == "eagle"` is a table that escaped it)."""
    asks = re.compile(r"\.method\b|\.proposer\b|\.own_vocab\b")
    wrong = [f"{path.name}:{node.lineno}: {ast.unparse(node)}" for path in sorted((ROOT / "export").glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Compare)
             and asks.search(ast.unparse(node))]  # fmt: skip
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "fmt,rope,cfg,weights",
    [
        ("eagle", "plain", {}, False),
        ("eagle", "linear", {"num_layers": 2}, True),
        ("eagle", "theta", {"fc_bias": False}, False),
        ("eagle", "dynamic", {}, False),
        ("sglang", "llama3", {}, False),
        ("sglang", "theta", {"fc_bias": False, "num_layers": 2}, False),
        ("vllm", "llama3", {"fc_bias": False}, False),
        ("vllm", "plain", {"fc_bias": False, "num_layers": 2}, True),
    ],
)
def test_good_eagle_exports_pass(fmt, rope, cfg, weights, targets, recipe, tmp_path):
    target = targets[rope]
    drafter = eagle(target, **cfg)
    out = write(fmt, tmp_path / fmt, recipe, target, drafter, weights)
    assert check(fmt, out, recipe, target, drafter) < 1e-4


@pytest.mark.parametrize("fmt,cfg", [("medusa", {}), ("medusa", {"share_lm_head": True}), ("vllm", {}),
                                     ("vllm", {"num_heads": 3, "num_layers": 2, "share_lm_head": True})])  # fmt: skip
def test_good_medusa_exports_pass(fmt, cfg, targets, recipe, tmp_path):
    target = targets["plain"]
    drafter = medusa(target, **{"num_heads": 5, **cfg})
    out = write(fmt, tmp_path / fmt, recipe, target, drafter)
    assert check(fmt, out, recipe, target, drafter) < 1e-4


def test_sglang_without_fc_bias_keeps_a_random_bias(targets, recipe, tmp_path):
    target = targets["plain"]
    drafter = eagle(target, fc_bias=False)
    out = write("sglang", tmp_path / "s", recipe, target, drafter)
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["fc.bias"]  # what the writer used to do: SGLang then keeps its uninitialised bias
    save_file(tensors, str(out / "model.safetensors"))
    msg = one_line_error(r"^sglang load gate: .* differ by", "sglang", out, recipe, target, drafter)
    assert "fc.bias missing from model.safetensors" in msg


@pytest.mark.parametrize("fmt", ["eagle", "sglang", "vllm"])
def test_a_missing_rope_theta_is_caught(fmt, targets, recipe, tmp_path):
    target = targets["theta"]
    drafter = eagle(target, fc_bias=False)
    out = write(fmt, tmp_path / fmt, recipe, target, drafter)
    config = json.loads((out / "config.json").read_text())
    del config["rope_theta"]  # a transformers-4 consumer falls back to 10000, whatever rope_parameters says
    (out / "config.json").write_text(json.dumps(config))
    msg = one_line_error(f"^{fmt} load gate: .* differ by", fmt, out, recipe, target, drafter)
    assert "config.json has no rope_theta (the consumer uses 10000.0)" in msg and "the target's 500000.0" in msg


@pytest.mark.parametrize("fmt,rope", [("eagle", "linear"), ("vllm", "llama3")])
def test_a_missing_rope_scaling_is_caught(fmt, rope, targets, recipe, tmp_path):
    target = targets[rope]
    drafter = eagle(target, fc_bias=fmt == "eagle")
    out = write(fmt, tmp_path / fmt, recipe, target, drafter)
    config = json.loads((out / "config.json").read_text())
    del config["rope_scaling"]
    (out / "config.json").write_text(json.dumps(config))
    msg = one_line_error(f"^{fmt} load gate: .* differ by", fmt, out, recipe, target, drafter)
    assert f"rope_scaling is None, the target's RoPE type '{rope}'" in msg


@pytest.mark.parametrize(
    "rope,why",
    [
        ("llama3", "the target has RoPE type 'llama3'"),
        ("linear-theta", "the target has scaled RoPE on rope_theta 500000.0"),
    ],
)
def test_safeailab_refuses_rope_it_cannot_build(rope, why, targets, recipe, tmp_path):
    """SafeAILab's EConfig takes only linear or dynamic scaling, and it builds them on base 10000."""
    with pytest.raises(ExportError, match=f"SafeAILab EAGLE-1/2 builds .* only, {why}; export --format vllm") as err:
        write("eagle", tmp_path / "e", recipe, targets[rope], eagle(targets[rope]))
    assert "\n" not in str(err.value)


def test_safeailab_loads_scaling_in_its_two_key_form_only(targets, recipe, tmp_path):
    """The `rope_scaling` transformers 4 writes (`rope_type` beside `type`) fails SafeAILab's EConfig at load; and
    SafeAILab builds scaled RoPE on base 10000 whatever `rope_theta` says, which the gate catches too (what the
    writer refuses to write for such a target)."""
    target = targets["linear"]
    drafter = eagle(target)
    out = write("eagle", tmp_path / "e", recipe, target, drafter)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {"type": "linear", "factor": 4.0}
    config["rope_scaling"]["rope_type"] = "linear"
    (out / "config.json").write_text(json.dumps(config))
    one_line_error("rope_scaling .*: SafeAILab's EConfig refuses it", "eagle", out, recipe, target, drafter)

    target = targets["linear-theta"]
    drafter = eagle(target)
    out = tmp_path / "theta"
    out.mkdir()
    eagle_layouts._write_eagle(out, target, drafter, False, "vllm")  # SafeAILab's layout without its RoPE rules
    export_mod.write_pt(load_file(str(out / "model.safetensors")), out / EAGLE_PT)
    config = json.loads((out / "config.json").read_text())
    config["rope_scaling"] = {"type": "linear", "factor": 4.0}
    (out / "config.json").write_text(json.dumps(config))
    msg = one_line_error("^eagle load gate: .* differ by", "eagle", out, recipe, target, drafter)
    assert "rope_theta 500000.0 is ignored: scaled RoPE is built on base 10000" in msg


@pytest.mark.parametrize("fmt,key", [("eagle", "qkv_bias"), ("sglang", "attention_bias"), ("vllm", "attention_bias")])
def test_a_target_with_attention_biases_exports_a_drafter_without(fmt, key, targets, recipe, tmp_path):
    """The EAGLE-1/2 layouts copy the target's config; the drafter's layers have no biases, so the export says so:
    each consumer would otherwise build q/k/v biases the file lacks and keep them at their initial values."""
    target = targets["biased"]
    drafter = eagle(target, fc_bias=fmt != "vllm")
    out = write(fmt, tmp_path / fmt, recipe, target, drafter)
    config = json.loads((out / "config.json").read_text())
    assert config["attention_bias"] is False and config["mlp_bias"] is False and "qkv_bias" not in config
    assert check(fmt, out, recipe, target, drafter) < 1e-4
    config[key] = True
    (out / "config.json").write_text(json.dumps(config))
    msg = one_line_error(f"^{fmt} load gate: .* differ by", fmt, out, recipe, target, drafter)
    assert "layers.0.self_attn.q_proj.bias missing" in msg


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_engines_building_dynamic_rope_with_a_fixed_base_are_refused(fmt, targets, recipe, tmp_path):
    """vLLM and SGLang build dynamic NTK RoPE with one base for every length, not transformers' growing one (the
    same export passes SafeAILab's gate above)."""
    target = targets["dynamic"]
    drafter = eagle(target, fc_bias=fmt != "vllm")
    out = write(fmt, tmp_path / fmt, recipe, target, drafter)
    msg = one_line_error("rope_scaling type 'dynamic': this consumer builds NTK scaling with one fixed base", fmt,
                         out, recipe, target, drafter)  # fmt: skip
    assert "only --format eagle, for EAGLE-1/2 drafters" in msg


def test_dynamic_rope_grows_its_base_as_transformers_does():
    """The gate's NTK base for sequences past `max_position_embeddings` is transformers' own (and the default
    base up to it)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    config = LlamaConfig(**TINY, max_position_embeddings=8, rope_parameters=rope)
    legacy = {"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 4.0}, "max_position_embeddings": 8}
    for length in (5, 8, 13, 40):
        positions = torch.arange(length)[None]
        cos, sin = rope_cos_sin(legacy, 16, positions, [], length_dependent_ntk=True)
        inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=length)
        freqs = positions[0, :, None].float() * inv[None]
        assert torch.allclose(cos[0], torch.cat([freqs, freqs], -1).cos(), atol=1e-6), length
        assert torch.allclose(sin[0], torch.cat([freqs, freqs], -1).sin(), atol=1e-6), length
    notes = []
    rope_cos_sin({k: v for k, v in legacy.items() if k != "max_position_embeddings"}, 16, positions, notes, True, True)
    assert notes == ["config.json has no max_position_embeddings (the consumer uses 2048)"]


def test_an_unknown_rope_type_is_refused_not_guessed(targets, recipe, tmp_path):
    target = targets["plain"]
    drafter = eagle(target)
    out = write("sglang", tmp_path / "s", recipe, target, drafter)
    config = json.loads((out / "config.json").read_text())
    config["rope_scaling"] = {"type": "yarn", "factor": 4.0}
    (out / "config.json").write_text(json.dumps(config))
    one_line_error("rope_scaling type 'yarn'", "sglang", out, recipe, target, drafter)


def test_safeailab_without_a_bias_key_builds_a_biased_fc(targets, recipe, tmp_path):
    """SafeAILab reads `bias` (default True) for fc: dropping the key from a bias-free export gives a random bias."""
    target = targets["plain"]
    drafter = eagle(target, fc_bias=False)
    out = write("eagle", tmp_path / "e", recipe, target, drafter)
    config = json.loads((out / "config.json").read_text())
    del config["bias"]
    (out / "config.json").write_text(json.dumps(config))
    msg = one_line_error("^eagle load gate", "eagle", out, recipe, target, drafter)
    assert "config.json has no bias (the consumer uses True)" in msg and "fc.bias missing" in msg


def test_vllm_drops_an_fc_bias(targets, recipe, tmp_path):
    target = targets["plain"]
    drafter = eagle(target, fc_bias=True)
    out = tmp_path / "v"
    out.mkdir()
    eagle_layouts.write_eagle(out, recipe, target, drafter, False)  # what `write_vllm_eagle` refuses to do
    msg = one_line_error("^vllm load gate", "vllm", out, recipe, target, drafter)
    assert "fc.bias in model.safetensors is dropped" in msg


def test_a_three_head_medusa_loaded_the_fasterdecoding_way(targets, recipe, tmp_path):
    target = targets["plain"]
    drafter = medusa(target, num_heads=3)
    out = write("medusa", tmp_path / "m", recipe, target, drafter)  # past the writer's refusal
    msg = one_line_error(r"^medusa load gate: .* shape \(5, ", "medusa", out, recipe, target, drafter)
    assert "medusa_num_heads: the consumer builds 5 heads, the drafter has 3" in msg


def test_a_two_layer_medusa_loaded_the_fasterdecoding_way(targets, recipe, tmp_path):
    target = targets["plain"]
    drafter = medusa(target, num_heads=5, num_layers=2)
    out = write("medusa", tmp_path / "m", recipe, target, drafter)
    msg = one_line_error("^medusa load gate: .* differ by", "medusa", out, recipe, target, drafter)
    assert "medusa_num_layers: the consumer shares one ResBlock" in msg


def test_medusa_pt_must_load_with_weights_only(targets, recipe, tmp_path):
    target = targets["plain"]
    drafter = medusa(target, num_heads=5)
    out = write("medusa", tmp_path / "m", recipe, target, drafter)
    torch.save({"0.0.linear.weight": torch.zeros(1), "args": argparse.Namespace(x=1)}, out / MEDUSA_PT)
    one_line_error(r"medusa_lm_head.pt: not loadable with torch.load\(weights_only=True\)", "medusa", out, recipe,
                   target, drafter)  # fmt: skip


def test_eagle_pytorch_model_bin_must_hold_the_safetensors_tensors(targets, recipe, tmp_path):
    target = targets["plain"]
    drafter = eagle(target)
    out = write("eagle", tmp_path / "e", recipe, target, drafter)
    assert check("eagle", out, recipe, target, drafter) < 1e-5
    state = torch.load(out / EAGLE_PT, weights_only=True)
    state["fc.weight"] = state["fc.weight"] + 1
    torch.save(state, out / EAGLE_PT)
    one_line_error("^eagle load gate: model.safetensors and pytorch_model.bin hold different tensors", "eagle", out,
                   recipe, target, drafter)  # fmt: skip


@pytest.mark.parametrize("fmt", ["eagle", "sglang", "vllm"])
def test_eagle_layouts_describe_the_drafter_s_layers_not_the_target_s(fmt, recipe, tmp_path):
    """A Qwen2 target's per-layer `layer_types` (one per target layer) or a GELU target's `hidden_act`, copied into the
    one-layer drafter's config, would be refused by transformers (so by vLLM and SGLang) or describe another MLP."""
    from transformers import AutoConfig

    for name, config in {
        "qwen2": dict(TINY, model_type="qwen2", num_hidden_layers=3, sliding_window=32, use_sliding_window=True),
        "gelu": dict(TINY, hidden_act="gelu_pytorch_tanh"),
    }.items():
        target = load_target(random_init=config, dtype="float32")
        drafter = eagle(target, fc_bias=False)  # vLLM's fc has none
        out = write(fmt, tmp_path / f"{fmt}-{name}", recipe, target, drafter)
        assert check(fmt, out, recipe, target, drafter) < 1e-5
        parsed = AutoConfig.from_pretrained(out)
        assert (parsed.num_hidden_layers, parsed.hidden_act) == (1, "silu")
        assert getattr(parsed, "layer_types", None) in (None, ["full_attention"])
        assert not getattr(parsed, "use_sliding_window", False) and getattr(parsed, "sliding_window", None) is None
    if fmt != "eagle":  # SafeAILab's EConfig does not validate; vLLM and SGLang parse with transformers
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(dict(config, layer_types=["full_attention"] * 3)))
        one_line_error("^config.json: transformers' AutoConfig .* refuses it: .*layer_types", fmt, out, recipe,
                       target, drafter)  # fmt: skip


def test_a_failing_gate_leaves_nothing(targets, recipe, tmp_path, monkeypatch):
    """Through `export.write.export`: the gate runs inside `<out>.tmp`, which a failure removes."""
    target = targets["plain"]
    drafter = eagle(target, fc_bias=False)
    run_recipe = load_recipe(ROOT / "recipes/tiny/eagle2.yaml", ["drafter.fc_norm=false", "drafter.post_norm=false"])
    monkeypatch.setattr(export_mod, "load_run", lambda run_dir, checkpoint=None: (run_recipe, target, drafter))

    original = eagle_layouts.write_sglang

    def broken(out, *args):
        original(out, *args)
        tensors = load_file(str(out / "model.safetensors"))
        del tensors["fc.bias"]
        save_file(tensors, str(out / "model.safetensors"))

    monkeypatch.setattr(eagle_layouts, "write_sglang", broken)  # the method's writer, as its entry names it
    with pytest.raises(ExportError, match="^sglang load gate: .*fc.bias missing"):
        export_mod.export(tmp_path / "run", tmp_path / "out", fmt="sglang")
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(eagle_layouts, "write_sglang", original)
    out = export_mod.export(tmp_path / "run", tmp_path / "out", fmt="sglang")
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "config.json", "model.safetensors"]


def test_other_values_are_caught_too(targets, recipe, tmp_path):
    target = targets["plain"]
    drafter = eagle(target)
    out = write("eagle", tmp_path / "e", recipe, target, drafter)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["layers.0.mlp.down_proj.weight"] = tensors["layers.0.mlp.down_proj.weight"] * 1.01
    save_file(tensors, str(out / "model.safetensors"))
    export_mod.write_pt(tensors, out / EAGLE_PT)  # both files, as a writer bug would leave them
    one_line_error("^eagle load gate: .* differ by .*no field fell back", "eagle", out, recipe, target, drafter)


@pytest.mark.parametrize("fmt", ["eagle", "sglang", "vllm"])
def test_a_bf16_target_passes_and_is_still_checked(fmt, targets, recipe, tmp_path):
    target = targets["bf16"]
    drafter = eagle(target, fc_bias=False)
    out = write(fmt, tmp_path / fmt, recipe, target, drafter)
    check(fmt, out, recipe, target, drafter)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 2  # a layer the file does not have: random weights
    (out / "config.json").write_text(json.dumps(config))
    one_line_error(f"^{fmt} load gate: .*layers.1.self_attn.q_proj.weight missing", fmt, out, recipe, target, drafter)


def test_float32_medusa_heads_of_a_bf16_target_are_checked_at_float32_tolerance(targets, recipes, tmp_path):
    """Heads with lm_heads of their own never project through the target's bf16 lm_head: a 1% change to one head
    must fail the gate, not pass under the 16-bit tolerance."""
    target = targets["bf16"]
    drafter = medusa(target, num_heads=3, share_lm_head=False).float()
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}
    out = write("vllm", tmp_path / "vllm", recipes["medusa"], target, drafter)
    assert check("vllm", out, recipes["medusa"], target, drafter) < 1e-5
    tensors = load_file(str(out / "model.safetensors"))
    tensors["lm_heads.2.weight"] = tensors["lm_heads.2.weight"] * 1.01
    save_file(tensors, str(out / "model.safetensors"))
    one_line_error("^vllm load gate: .* differ by", "vllm", out, recipes["medusa"], target, drafter)


def test_native_gate_reloads_strictly_and_compares_logits(targets, recipes, tmp_path):
    from models.io import save_native

    target = targets["plain"]
    for drafter, recipe in ((eagle(target), recipes["eagle"]), (medusa(target, num_heads=2), recipes["medusa"])):
        out = save_native(tmp_path / drafter.cfg.method, drafter, target)
        assert check("native", out, recipe, target, drafter) == 0.0
        other = perturbed(type(drafter)(drafter.cfg, target.parts([-1])), seed=7)  # same layout, other weights
        one_line_error("^native load gate: .* differ by", "native", out, recipe, target, other)


def test_a_gate_without_logits_only_reloads(targets, recipes, tmp_path, monkeypatch):
    """Methods the native gate has no logit path for (a new drafter type) pass on the strict reload alone."""
    from export import gates

    target = targets["plain"]
    drafter = eagle(target)
    bare = lambda *a: gates.GateResult(torch.zeros(0), torch.zeros(0))  # noqa: E731
    monkeypatch.setattr(gates, "gate", lambda fmt, method: bare)
    assert check("native", tmp_path, recipes["eagle"], target, drafter) == 0.0
    monkeypatch.undo()
    msg = "^export.format: nope is not a format of eagle2 drafters"
    one_line_error(msg, "nope", tmp_path, recipes["eagle"], target, drafter)
