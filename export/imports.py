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
  reads): `midlayer.*` resp. `layers.0.*` (and `layers.1.*`, ... of a speculators drafter of several layers),
  `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optionally `fc_norm.{i}.weight` and
  `embed_tokens.weight`, into an `eagle3` drafter (`import_eagle3`: the fused layers from the config's aux layer ids
  in that engine's numbering, or low/mid/high; the layer count from `num_hidden_layers`).
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
import re
import sys
from pathlib import Path

import torch
from torch import nn

from export.gate_parts import MEDUSA_PT, MEDUSA_SAFETENSORS, read_pt
from export.gates import compute_dtype, tolerance
from methods import METHODS, resolve
from models.io import (
    FORMAT,
    ExportError,
    check_export_dir,
    load_drafter,
    read_json,
    read_safetensors,
    save_native,
    staged_directory,
    verify_files,
)
from models.target import Target, TargetError, load_target
from rundir.lock import DirectoryLocked, NotADirectory, directory_lock
from schema.recipe import RecipeError, load_recipe

IMPORTERS = {fmt: path for method in METHODS.values() for fmt, path in method.imports.items()}
"""Every importable layout -> its importer, as the methods declare them (`methods.method.Method.imports`)."""
FORMATS = tuple(IMPORTERS)
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


def int_field(config: dict, key: str, default: int | None, where: Path) -> int:
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


def check_close(
    consumer: torch.Tensor,
    reference: torch.Tensor,
    native: nn.Module,
    target: Target,
    weights: Path,
    who: str,
    notes: list[str],
) -> None:
    """The imported drafter's draft logits (`reference`) against the source's as its consumer loads it, within the
    tolerance of the dtype they run in; else one line naming the weights file."""
    diff = (consumer - reference).abs().max().item()
    if not diff <= tolerance(reference, compute_dtype(native, target)):
        raise ExportError(
            f"{weights}: the imported drafter's draft logits differ from the checkpoint's, as {who} loads it, by "
            f"{diff:.3g} ({'; '.join(notes) or 'no field fell back on a default'})"
        )


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
    drafter, check = resolve(IMPORTERS[fmt])(src, config, tensors, weights, target)
    drafter = drafter.to(target.device).eval()
    # one import at a time into `out` (a lock file beside it), renamed into place once verified: a failed import
    # leaves nothing
    with directory_lock(out, "import", key="--out", beside=True), staged_directory(out) as tmp:
        save_native(tmp, drafter, target, {"imported_from": str(src.resolve()), "format": fmt})
        check(load_drafter(tmp, target))  # the reloaded native drafter against the source, as its consumer reads it
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
