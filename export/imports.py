"""Import an existing SafeAILab EAGLE-1/2/3, speculators or FasterDecoding Medusa checkpoint as a native export.

    python -m export.imports SRC --format eagle|medusa|eagle3|speculators --target RECIPE.yaml|TARGET_DIR --out DIR
                            [--dtype DTYPE]

`SRC` is the checkpoint directory: `config.json` plus
- `eagle` (SafeAILab EAGLE-1/2, `cnets1.py`): `model.safetensors`, else `pytorch_model.bin`; `fc.weight`,
  `fc.bias` (when `bias`, default true), `layers.{i}.*` for `num_hidden_layers` Llama layers (layer 0 without
  input_layernorm), optionally `embed_tokens.weight` (must equal the target's);
- `medusa` (FasterDecoding Medusa): `medusa_lm_head.safetensors`, else `medusa_lm_head.pt`; `{h}.{l}.linear.weight|
  bias` and `{h}.{L}.weight` for every head in the file (as the consumer's loader, whatever `medusa_num_heads`
  says) of `medusa_num_layers` (default 1) layers. The consumer shares one ResBlock across a head's layers, so
  the last layer's tensors are imported into every layer: the native heads compute what the consumer computes.
- `eagle3` (SafeAILab EAGLE-3 / SGLang `LlamaForCausalLMEagle3`) and `speculators` (its EAGLE-3 layout, which vLLM
  reads): `midlayer.*` resp. `layers.0.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optionally
  `fc_norm.{i}.weight` and `embed_tokens.weight`, into an `eagle3` drafter (`import_eagle3`:
  the fused layers from the config's aux layer ids in that engine's numbering, or low/mid/high).
`.pt` / `.bin` files are read with `torch.load(weights_only=True)` only: tensors, never arbitrary pickle.
`--target` is a recipe (its `target` section) or a target model directory: the model the checkpoint drafts for.

The checkpoint's tensor names and shapes are checked against what the consumer's layout requires (missing or extra
tensors, a config it cannot read, a config that disagrees with the target: one line naming the file and field),
mapped into our drafter (EAGLE: `fc_norm: false`, `post_norm: false`, `feature_layers: [-1]`, `fc_bias` from the
config; Medusa: `num_heads`, `num_layers` from the checkpoint, one lm_head per head), written through `<out>.tmp`
and a rename, reloaded strictly with `models.io.load_drafter` and compared with the consumer-semantics loader of the
source (`export.gates`): the same draft logits, else nothing is written. Evaluate the result like any native export,
into a directory of its own: `python -m eval RECIPE eval.drafter=DIR eval.output_dir=DIR-eval`, with a recipe of the
same method (eagle2 / medusa1 / eagle3) and target.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from pathlib import Path

import torch
from torch import nn

from export import eagle3_gates
from export.eagle_gates import SAFEAILAB, eagle_consumer_logits, eagle_inputs, rope_hints
from export.gate_parts import MEDUSA_PT, MEDUSA_SAFETENSORS, read_pt
from export.gates import compute_dtype, tolerance
from export.medusa_gates import medusa_fd_logits, medusa_hidden
from models.configs import Eagle3Config, EagleConfig, MedusaConfig
from models.io import (
    FORMAT,
    ExportError,
    check_export_dir,
    legacy_rope,
    load_drafter,
    read_json,
    read_safetensors,
    save_native,
    staged_directory,
    verify_files,
)
from models.methods import METHODS
from models.target import Target, TargetError, load_target
from rundir.lock import DirectoryLocked, NotADirectory, directory_lock
from schema.recipe import RecipeError, load_recipe

FORMATS = ("eagle", "medusa", "eagle3", "speculators")
WEIGHTS = {
    "eagle": ("model.safetensors", "pytorch_model.bin"),
    "medusa": (MEDUSA_SAFETENSORS, MEDUSA_PT),
    "eagle3": ("model.safetensors", "pytorch_model.bin"),
    "speculators": ("model.safetensors",),
}
_MEDUSA_NAME = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def resolve_target(spec: str, dtype: str | None = None) -> Target:
    """`--target`: a recipe file (its `target` section) or a target model directory."""
    path = Path(spec)
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        fields = dataclasses.asdict(load_recipe(path).target)
        if dtype:
            fields["dtype"] = dtype
        return load_target(**fields)
    if path.is_dir():
        return load_target(path=str(path), dtype=dtype or "bfloat16")
    raise ExportError(f"--target: {spec}: neither a recipe (.yaml) nor a target model directory")


def read_source(src: Path, fmt: str) -> tuple[dict, dict[str, torch.Tensor], Path]:
    """(config, tensors, weights file) of a checkpoint directory in `fmt`'s layout."""
    if not src.is_dir():
        raise ExportError(f"{src}: no such checkpoint directory")
    config = read_json(src / "config.json")
    for name in WEIGHTS[fmt]:
        path = src / name
        if path.is_file():
            tensors = read_safetensors(path) if name.endswith(".safetensors") else read_pt(path)
            return config, tensors, path
    raise ExportError(f"{src}: no {' or '.join(WEIGHTS[fmt])} (a {fmt} checkpoint's weights)")


def looks_like(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[str, str] | None:
    """(format, evidence) a checkpoint's own fields point to, when they point clearly; None when they do not."""
    if config.get("format") == FORMAT:
        return "native", f"config.json says format {FORMAT!r}"
    if "transformer_layer_config" in config or "speculators_model_type" in config:
        return "speculators", "config.json has transformer_layer_config"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []) or any(
        k.startswith("midlayer.") for k in tensors
    ):
        return "eagle3", "LlamaForCausalLMEagle3 / midlayer.* tensors"
    if tensors and all(_MEDUSA_NAME.match(k) for k in tensors):
        return "medusa", "FasterDecoding's {head}.{layer}.linear.* tensors"
    if "fc.weight" in tensors and any(k.startswith("layers.") for k in tensors) and "d2t" not in tensors:
        return "eagle", "fc.weight and layers.* without a draft vocabulary"
    return None


def check_layout(src: Path, fmt: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Name the layout a checkpoint is in when `--format` asks for another, before any field is read."""
    found = looks_like(config, tensors)
    if found is None or found[0] == fmt:
        return
    layout, evidence = found
    if layout == "native":
        raise ExportError(f"{src}: already a native export ({evidence}): evaluate it with eval.drafter={src}")
    raise ExportError(
        f"{src}: its files are in the {layout} layout ({evidence}), not {fmt}: import it with --format {layout}"
    )


def _int_field(config: dict, key: str, default: int | None, where: Path) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ExportError(f"{where}: {key}: expected an integer >= 1, got {value!r}")
    return value


def check_tensors(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple], where: Path, layout: str, optional=()
) -> None:
    """Names and shapes exactly as the consumer's layout has them (`optional`: names it may carry as well)."""
    missing = sorted(expected.keys() - tensors.keys())
    extra = sorted(tensors.keys() - expected.keys() - set(optional))
    if missing:
        raise ExportError(f"{where}: missing tensors {missing[:5]} ({len(missing)} in all) for {layout}")
    if extra:
        raise ExportError(f"{where}: extra tensors {extra[:5]} ({len(extra)} in all) that {layout} does not have")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ExportError(f"{where}: {name} has shape {tuple(tensors[name].shape)}, {layout} needs {tuple(shape)}")


def import_eagle(src: Path, config: dict, tensors: dict, weights: Path, target: Target) -> nn.Module:
    where = src / "config.json"
    tc = target.config
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if config.get(key) != getattr(tc, key):
            raise ExportError(f"{where}: {key} is {config.get(key)!r}, the target's is {getattr(tc, key)!r}")
    kv, target_kv = config.get("num_key_value_heads"), getattr(tc, "num_key_value_heads", None)
    if (kv or config["num_attention_heads"]) != (target_kv or tc.num_attention_heads):
        raise ExportError(f"{where}: num_key_value_heads is {kv!r}, the target's is {target_kv!r}")
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if head_dim != tc.hidden_size // tc.num_attention_heads:
        raise ExportError(
            f"{where}: SafeAILab's layers use hidden_size // num_attention_heads as head_dim, the target's {head_dim}"
        )
    hints = rope_hints(config, tc)
    if hints:  # our drafter runs with the target's RoPE
        raise ExportError(f"{where}: {'; '.join(hints)} (SafeAILab's default rope_theta is 10000)")
    layers = _int_field(config, "num_hidden_layers", 1, where)
    fc_bias = config.get("bias", True)
    if not isinstance(fc_bias, bool):
        raise ExportError(f"{where}: bias: expected true or false, got {fc_bias!r}")
    cfg = EagleConfig(feature_layers=[-1], num_layers=layers, fc_norm=False, post_norm=False, fc_bias=fc_bias)
    drafter = METHODS["eagle2"].module()(cfg, target.parts([-1]))
    expected = {name: tuple(t.shape) for name, t in drafter.trainable_state_dict().items()}
    layout = f"a SafeAILab EAGLE-1/2 drafter with num_hidden_layers={layers}, bias={str(fc_bias).lower()}"
    check_tensors(tensors, expected, weights, layout, optional=("embed_tokens.weight",))
    if "embed_tokens.weight" in tensors:
        embed = target.embed_tokens.weight
        theirs = tensors["embed_tokens.weight"]
        # in the checkpoint's dtype: a trainer that saves in bf16 holds the target's embedding rounded to it
        if theirs.shape != embed.shape or not torch.equal(theirs.to(embed.device), embed.to(theirs.dtype)):
            raise ExportError(f"{weights}: embed_tokens.weight differs from the target's embedding (another target?)")
    drafter.load_state_dict({k: tensors[k] for k in expected}, strict=False)
    return drafter


def import_eagle3(config: dict, tensors: dict[str, torch.Tensor], weights: Path, target, speculators: bool):
    """A SafeAILab / SGLang EAGLE-3 checkpoint (`midlayer.*`; aux ids from `eagle_config` in SGLang's numbering, else
    the consumers' default low/mid/high) or a speculators one (`layers.0.*`, its flags) -> (Eagle3Drafter, reader)."""
    reader = eagle3_gates.SPECULATORS if speculators else eagle3_gates.SGLANG
    where = weights.parent / "config.json"
    layer = config.get("transformer_layer_config") if speculators else config
    if not isinstance(layer, dict):
        raise ExportError(f"{where}: transformer_layer_config: expected an object, got {layer!r}")
    tc = target.config
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if layer.get(key) != getattr(tc, key):
            raise ExportError(f"{where}: {key} is {layer.get(key)!r}, the target's is {getattr(tc, key)!r}")
    if layer.get("num_hidden_layers", 1) != 1:
        raise ExportError(f"{where}: num_hidden_layers is {layer.get('num_hidden_layers')}: one decoder layer only")
    check_layer_fields(layer, tc, where)
    K = _int_field(config, "draft_vocab_size", None, where)
    L = tc.num_hidden_layers
    ids = (config.get("eagle_aux_hidden_state_layer_ids") if speculators else None) or (
        config.get("eagle_config") or {}
    ).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        check_aux_ids(ids, L, reader, where)
    # the engines capture each listed layer once, in layer order, and fuse them in that order
    layers = sorted({i + reader.aux_offset for i in ids}) if ids else [2, L // 2, L - 3]
    if speculators and "norm_before_residual" not in config:  # the two readers of this layout disagree here
        raise ExportError(
            f"{where}: no norm_before_residual: vLLM reads a missing one as true, the speculators package as false, "
            "so this drafter computes differently in each; add the value it was trained with"
        )
    flags = {k: bool(config.get(k, False)) for k in ("fc_norm", "norm_output", "norm_before_residual")}
    if not speculators and any(flags.values()):
        raise ExportError(f"{where}: {[k for k, v in flags.items() if v]}: SGLang's EAGLE-3 layout has no such flag")
    if config.get("norm_before_fc"):
        raise ExportError(f"{where}: norm_before_fc: not supported by the eagle3 method (use fc_norm)")
    cfg = Eagle3Config(feature_layers=layers, draft_vocab=K, ttt_steps=1, **flags)

    def err(key: str, msg: str) -> None:
        raise ExportError(f"{where}: {key} (from the checkpoint's config): {msg}")

    cfg.validate(err)
    drafter = METHODS["eagle3"].module()(cfg, target.parts([*layers, -1]))
    prefix = "layers.0." if speculators else "midlayer."
    ours = {name: tuple(t.shape) for name, t in drafter.trainable_state_dict().items()}
    expected = {n.replace("midlayer.", prefix, 1) if n.startswith("midlayer.") else n: v for n, v in ours.items()}
    if "d2t" not in tensors:
        raise ExportError(f"{weights}: no d2t (the draft vocabulary's offsets)")
    layout = f"{'a speculators' if speculators else 'an EAGLE-3'} drafter with draft_vocab_size={K}"
    check_tensors(tensors, expected, weights, layout, optional=("embed_tokens.weight",))
    if "embed_tokens.weight" in tensors and not torch.equal(
        tensors["embed_tokens.weight"].to(target.embed_tokens.weight.device),
        target.embed_tokens.weight.to(tensors["embed_tokens.weight"].dtype),  # the checkpoint's dtype (bf16 savers)
    ):
        raise ExportError(f"{weights}: embed_tokens.weight differs from the target's embedding (another target?)")
    draft_ids = torch.arange(K) + tensors["d2t"].to(torch.int64)
    if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= tc.vocab_size or len(draft_ids.unique()) != K:
        raise ExportError(f"{weights}: d2t does not map {K} draft ids to distinct target ids (ids instead of offsets?)")
    t2d = torch.zeros(tc.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    if not torch.equal(tensors["t2d"].bool(), t2d):
        raise ExportError(f"{weights}: t2d does not mark exactly the target ids d2t maps to")
    drafter.set_draft_vocab(draft_ids, init_head=False)
    order = draft_ids.argsort()  # our draft ids are sorted by target id: reorder the head's rows the same way
    state = {n: tensors[e] for n, e in zip(ours, expected) if n not in ("d2t", "t2d")}
    state["lm_head.weight"] = state["lm_head.weight"][order]
    drafter.load_state_dict(state, strict=False)
    return drafter, reader


def check_layer_fields(layer: dict, tc, where: Path) -> None:
    """The decoder layer's config against the target's (the drafter runs with the target's): KV heads, head_dim,
    RMSNorm epsilon and RoPE, each named when it differs, before anything is computed."""
    kv, target_kv = layer.get("num_key_value_heads"), getattr(tc, "num_key_value_heads", None)
    if (kv or layer["num_attention_heads"]) != (target_kv or tc.num_attention_heads):
        raise ExportError(f"{where}: num_key_value_heads is {kv!r}, the target's is {target_kv!r}")
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if layer.get("head_dim", head_dim) != head_dim:
        raise ExportError(f"{where}: head_dim is {layer.get('head_dim')!r}, the target's is {head_dim}")
    eps = layer.get("rms_norm_eps")
    if eps is not None and not math.isclose(float(eps), tc.rms_norm_eps, rel_tol=1e-6):
        raise ExportError(f"{where}: rms_norm_eps is {eps!r}, the target's is {tc.rms_norm_eps!r}")
    view = dict(layer)
    if layer.get("rope_parameters") and "rope_theta" not in layer:  # transformers-5 fields only
        view.update(legacy_rope(layer))
    hints = rope_hints(view, tc)
    if hints:
        raise ExportError(f"{where}: {'; '.join(hints)}")


def check_aux_ids(ids, num_layers: int, reader: eagle3_gates.Eagle3Reader, where: Path) -> None:
    """eagle_aux_hidden_state_layer_ids: distinct integers the engine can capture (vLLM / speculators: inputs of
    layers 0..L-1; SGLang / SafeAILab: outputs of layers 0..L-2, the last one's reaching HF only after the norm)."""
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ExportError(f"{where}: eagle_aux_hidden_state_layer_ids: expected a list of integers, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise ExportError(f"{where}: eagle_aux_hidden_state_layer_ids: {ids} names a layer twice")
    hi = num_layers - 1 - reader.aux_offset  # the last HF index an engine captures is L - 1
    bad = [i for i in ids if not 0 <= i <= hi]
    if bad:
        raise ExportError(
            f"{where}: eagle_aux_hidden_state_layer_ids: {bad} out of range: {reader.name} captures ids 0..{hi} of a "
            f"{num_layers}-layer target"
        )


def import_medusa(src: Path, config: dict, tensors: dict, weights: Path, target: Target) -> nn.Module:
    where = src / "config.json"
    L = _int_field(config, "medusa_num_layers", 1, where)
    heads_in_file = {int(m.group(1)) for m in map(_MEDUSA_NAME.match, tensors) if m}
    # FasterDecoding's loader builds its heads whatever `medusa_num_heads` says (its published configs say 2 beside
    # 5 heads' weights), so the file decides; the config only gets a note when it disagrees.
    K = max(heads_in_file, default=-1) + 1
    if K == 0:
        raise ExportError(f"{weights}: no Medusa head tensors ({{h}}.{{l}}.linear.weight, {{h}}.{{L}}.weight)")
    said = config.get("medusa_num_heads")
    if said is not None and said != K:
        print(f"note: {where}: medusa_num_heads is {said!r}, {weights.name} holds {K} heads: importing {K}",
              file=sys.stderr)  # fmt: skip
    cfg = MedusaConfig(num_heads=K, num_layers=L, share_lm_head=False)
    drafter = METHODS["medusa1"].module()(cfg, target.parts([-1]))
    ours = {name: tuple(t.shape) for name, t in drafter.trainable_state_dict().items()}
    names = {f"blocks.{h}.layers.{l}.{k}": f"{h}.{l}.linear.{k}" for h in range(K) for l in range(L) for k in
             ("weight", "bias")} | {f"lm_heads.{h}.weight": f"{h}.{L}.weight" for h in range(K)}  # fmt: skip
    layout = f"FasterDecoding Medusa heads with medusa_num_heads={K}, medusa_num_layers={L}"
    check_tensors(tensors, {theirs: ours[mine] for mine, theirs in names.items()}, weights, layout)
    # One ResBlock shared across a head's layers: the last one loaded is what every layer computes.
    state = {
        f"blocks.{h}.layers.{l}.{k}": tensors[f"{h}.{L - 1}.linear.{k}"]
        for h in range(K)
        for l in range(L)
        for k in ("weight", "bias")
    }
    state |= {f"lm_heads.{h}.weight": tensors[f"{h}.{L}.weight"] for h in range(K)}
    drafter.load_state_dict(state, strict=True)
    return drafter


def verify(fmt: str, native: nn.Module, config: dict, tensors: dict, weights: Path, target: Target) -> float:
    """The native drafter's draft logits against the consumer-semantics loader of the source checkpoint."""
    notes: list[str] = []
    with torch.no_grad():
        if fmt == "eagle":
            batch, features, next_ids = eagle_inputs(native, target.config.vocab_size)
            consumer = eagle_consumer_logits(
                config, tensors, weights.name, SAFEAILAB, target, features, next_ids, batch["position_ids"], notes
            )
            reference = native.logits(native.predict_features(batch))
        else:
            hidden = medusa_hidden(native, target.config.hidden_size)
            vocab = target.config.vocab_size
            consumer = medusa_fd_logits(config, tensors, weights.name, hidden, vocab, notes, native.cfg.num_heads)
            reference = native.head_logits(hidden).float()
    diff = (consumer - reference).abs().max().item()
    if not diff <= tolerance(reference, compute_dtype(native, target)):
        raise ExportError(
            f"{weights}: the imported drafter's draft logits differ from the checkpoint's, as its consumer loads it, "
            f"by {diff:.3g} ({'; '.join(notes) or 'no field fell back on a default'})"
        )
    return diff


def import_checkpoint(src: str | Path, fmt: str, target: Target, out: str | Path) -> Path:
    """Import `src` (a `fmt` checkpoint drafting for `target`) as a native export at `out`; return `out`."""
    if fmt not in FORMATS:
        raise ExportError(f"--format: {fmt!r} is not importable (available: {', '.join(FORMATS)})")
    src, out = Path(src), Path(out)
    check_export_dir(out, source=src)  # never replaces the checkpoint itself, or a directory no export wrote
    verify_files(src)  # a checkpoint an export of this project wrote: its files as written
    config, tensors, weights = read_source(src, fmt)
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype is not None and not isinstance(getattr(torch, str(dtype).removeprefix("torch."), None), torch.dtype):
        raise ExportError(f"{weights.parent / 'config.json'}: dtype {dtype!r} is not a torch dtype")
    check_layout(src, fmt, config, tensors)
    reader = None
    if fmt in ("eagle3", "speculators"):
        drafter, reader = import_eagle3(config, tensors, weights, target, fmt == "speculators")
    else:
        drafter = (import_eagle if fmt == "eagle" else import_medusa)(src, config, tensors, weights, target)
    drafter = drafter.to(target.device).eval()
    # one import at a time into `out` (a lock file beside it), renamed into place once verified: a failed import
    # leaves nothing
    with directory_lock(out, "import", key="--out", beside=True), staged_directory(out) as tmp:
        save_native(tmp, drafter, target, {"imported_from": str(src.resolve()), "format": fmt})
        if reader is not None:  # EAGLE-3: the layout's reader on the source, the reloaded native drafter
            result = eagle3_gates.compare(config, tensors, reader, target, load_drafter(tmp, target))
            diff = (result.consumer - result.reference).abs().max().item()
            if not diff <= tolerance(result.reference, compute_dtype(drafter, target)):
                raise ExportError(
                    f"{weights}: the imported drafter's draft logits differ from the checkpoint's, as "
                    f"{reader.name} loads it, by {diff:.3g} ({'; '.join(result.notes) or 'no field fell back'})"
                )
        else:
            verify(fmt, load_drafter(tmp, target), config, tensors, weights, target)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m export.imports", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="checkpoint directory (config.json + weights)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the checkpoint's layout")
    parser.add_argument("--target", required=True, help="a recipe (.yaml; its target section) or a target directory")
    parser.add_argument("--out", required=True, help="native export directory to write")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="target dtype (default: the recipe's, bfloat16 for a directory)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        target = resolve_target(args.target, args.dtype)
        out = import_checkpoint(args.src, args.format, target, args.out)
    except (ExportError, RecipeError, TargetError, FileNotFoundError, DirectoryLocked, NotADirectory) as exc:
        sys.exit(f"error: {exc}")
    print(f"imported {args.src} ({args.format}) -> {out}")


if __name__ == "__main__":
    main()
