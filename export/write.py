"""Export a trained drafter from a run directory.

    python -m export RUN_DIR [--out DIR] [--format native|medusa|eagle|sglang|vllm|speculators]
                                   [--checkpoint DIR]
                                   [--include-target-weights] [--merge-lora]
    python -m export NATIVE_EXPORT --format FORMAT --out DIR    # e.g. recipes/smollm2/drafters/medusa1

Reads the run's resolved recipe (`RUN_DIR/recipe.yaml`) and the newest checkpoint's gathered drafter
tensors (`drafter.safetensors`, written by every checkpoint whatever the parallelism), rebuilds the
drafter on the recipe's target and writes `config.json` + `model.safetensors` (never pickle) to `--out`:
by default `export.out` for the recipe's own format, else `RUN_DIR/export` for native and
`RUN_DIR/export-<format>` for an engine format, so each format has its own directory. A native export
carries `draft_vocab.safetensors` (the data's most frequent loss tokens) when the recipe drafts from a
vocabulary subset (`eval.draft_vocab`, `train.loss_vocab`), and is reloaded strictly
(`models.io.load_drafter`), with the same draft logits (the `native` gate), before the command reports success.
Drafters with an `export_extra` hook add their method-specific files next to it (Medusa-2: `heads/`, the LoRA
`adapter/`, `merged/` with --merge-lora). A native export (a shipped drafter) exports to an engine format too: the
recipe its config.json records and its drafter, loaded strictly on the target that recipe names, are written and
gated as a run's would be (the same files).

Engine formats, each a `config.json` + safetensors file:
- `medusa`: FasterDecoding Medusa, `medusa_lm_head.pt` (what its loader reads: a plain dict of tensors through
  `torch.save`, loadable with `torch.load(weights_only=True)`) and the same tensors in `medusa_lm_head.safetensors`,
  named `{h}.{l}.linear.weight|bias` and `{h}.{L}.weight`; config `medusa_num_heads`, `medusa_num_layers`,
  `base_model_name_or_path`. Its loader builds 5 heads whatever the config says (`strict=False`: other heads would
  be random) and shares one ResBlock across a head's layers, so only `drafter.num_heads=5`, `drafter.num_layers=1`
  export to it; others are refused (`vllm` holds any).
- `eagle` (SafeAILab EAGLE-1/2; its `EaModel.from_pretrained` needs `use_eagle3=False` to build one) and `sglang`
  (`LlamaForCausalLMEagle`): a Llama config with `num_hidden_layers` = `drafter.num_layers` plus `fc.weight`,
  `fc.bias` (`eagle`: with a `bias` key saying whether), `layers.{i}.*` (layer 0 without input_layernorm).
  Both configs carry `rope_theta` (and a legacy
  `rope_scaling` for scaled RoPE) beside `rope_parameters`, since transformers-4-based consumers read only those
  and fall back to base 10000. SGLang's fc always has a bias and its Llama layers read a `bias` key as attention
  biases, so the `sglang` layout writes no `bias` key and an `fc.bias` of zeros for a drafter trained without
  one. `eagle` also writes the same tensors as `pytorch_model.bin` (tensors only), the one file SafeAILab's PyPI
  release (`eagle-llm` 1.2.1) reads; that release loads strictly, so give it `--include-target-weights`, and it
  builds RoPE on base 10000 whatever `rope_theta` says (a note is printed for other bases). These layouts have no
  FC-Norm, post-norm or multi-layer fusion, so only drafters trained with
  `fc_norm: false`, `post_norm: false` and `feature_layers: [-1]` export to them; the others are refused rather
  than exported silently wrong.
- `vllm`: Medusa heads as vLLM's `MedusaModel` (`model_type: medusa`, `blocks.{h}.layers.{l}.*`,
  `lm_heads.{h}.weight`, `medusa_fc_bias: true`); EAGLE-1/2 drafters as `eagle` (vLLM reads that layout), only
  with `fc_bias: false`, since vLLM's EAGLE fc has no bias and it drops an `fc.bias` without a word.
- `speculators`, and `sglang` / `vllm` for `eagle3` drafters: the EAGLE-3 layouts of `methods.eagle3.layouts` (own
  LM head, `d2t` / `t2d`, each engine's auxiliary layer ids, the EAGLE-3.1 flags where the consumer reads them).
Which writer and which gate a format has for a method is that method's entry in `methods` (its `formats`).
Every export passes its load gate (`export.gates`) before it is renamed into place: a re-implementation of
the consumer's loading code (config fields and their defaults, tensor names, strictness) reloads it from the
directory and must give the trained drafter's draft logits, else the export fails naming the field.
The export is written under `<out>.tmp` and renamed once complete (a failed export leaves nothing behind; an
earlier export at `<out>` is replaced, any other existing directory refused), holding the lock
`.<out name>.specdraft.lock` beside `<out>` meanwhile: a second export into the same `<out>` is refused. Weights are
written through a temporary file and a rename; tensors that share memory (tied embeddings, heads sharing one
lm_head) are written as copies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch import nn

from data.chat import DataError
from data.heldout import HeldoutError, read_heldout
from data.prepare import prepare_dataset
from data.shards import FeatureDataset, FeatureMismatchError
from data.vocab_counts import loss_token_counts, most_frequent
from export.gates import check as gate_check
from methods import FORMATS, METHODS, resolve
from models.io import (
    CONFIG_FILE,
    DRAFT_VOCAB_FILE,
    ExportError,
    check_export_dir,
    draft_vocab_sha256,
    load_draft_vocab,
    load_drafter,
    read_config,
    read_safetensors,
    save_draft_vocab,
    save_native,
    staged_directory,
)
from models.io import FORMAT as NATIVE_FORMAT
from models.lm_head import fit_samples, save_factors
from models.target import Target, TargetError, load_target
from rundir.checkpoints import CheckpointError, latest_checkpoint, read_state
from rundir.lock import DirectoryLocked, NotADirectory, directory_lock
from schema.recipe import Recipe, RecipeError, load_recipe, recipe_from_dict
from train.checkpoint import DRAFTER_FILE, RECIPE_FILE

# Target config keys that describe the loading call, not the architecture (left out of engine configs).
VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation_autoset"}


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None) -> tuple[Recipe, Target, nn.Module]:
    """(recipe, target on CPU, drafter with the checkpoint's trained tensors) of a training run."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory (give the train.output_dir of a training run)")
    recipe = load_recipe(run_dir / RECIPE_FILE)
    ckpt = Path(checkpoint) if checkpoint is not None else latest_checkpoint(run_dir)
    if ckpt is None:
        raise ExportError(f"{run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    state = read_state(ckpt)
    if state["recipe_hash"] != recipe.section_hash("target", "data", "drafter"):
        raise ExportError(f"{ckpt}: trained with other target/data/drafter settings than {run_dir / RECIPE_FILE}")
    target = load_target(**dataclasses.asdict(recipe.target))
    cfg = recipe.drafter.without_inputs()  # Medusa-2: the checkpoint holds the heads trained from its stage-1 ones
    method = METHODS[recipe.drafter.method]
    drafter = method.module()(cfg, target.parts(recipe.data.layers))
    tensors = read_safetensors(ckpt / DRAFTER_FILE)
    if method.own_vocab:  # the draft vocabulary training chose, kept in the run directory
        vocab = load_draft_vocab(run_dir)
        if vocab is None:
            raise ExportError(f"{run_dir}: no {DRAFT_VOCAB_FILE} (the run's draft vocabulary, written by training)")
        if state.get("draft_vocab_sha256", draft_vocab_sha256(vocab)) != draft_vocab_sha256(vocab):
            raise ExportError(
                f"{run_dir / DRAFT_VOCAB_FILE}: not the draft vocabulary {ckpt} was trained with (its head rows belong "
                "to other tokens)"
            )
        drafter.set_draft_vocab(vocab, init_head=False)
        tensors.update({"d2t": drafter.d2t, "t2d": drafter.t2d})
    expected = drafter.trainable_state_dict().keys()
    if tensors.keys() != expected:
        raise ExportError(
            f"{ckpt / DRAFTER_FILE}: tensors {sorted(tensors.keys() ^ expected)[:5]} do not match the drafter"
        )
    drafter.load_state_dict(tensors, strict=False)
    return recipe, target, drafter.eval()


# --------------------------------------------------------------------------------------------
# Engine formats


def is_native_export(path: str | Path) -> bool:
    """A native export directory (e.g. a shipped drafter) rather than a run directory: a specdraft `config.json` and
    no run recipe."""
    path = Path(path)
    if (path / RECIPE_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        return False
    try:
        return json.loads((path / CONFIG_FILE).read_text()).get("format") == NATIVE_FORMAT
    except (json.JSONDecodeError, AttributeError):
        return False


def load_native(export_dir: str | Path) -> tuple[Recipe, Target, nn.Module]:
    """(recipe, target on CPU, drafter) of a native export: the recipe its config.json records (the one it was
    trained with), the target that recipe names, the drafter loaded strictly (`models.io.load_drafter`, which refuses
    another target)."""
    where = f"{Path(export_dir) / CONFIG_FILE}: recipe"
    recipe = recipe_from_dict(read_config(export_dir).get("recipe"), source=where)
    target = load_target(**dataclasses.asdict(recipe.target))
    return recipe, target, load_drafter(export_dir, target)


def export(
    run_dir: str | Path,
    out: str | Path | None = None,
    fmt: str | None = None,
    checkpoint: str | Path | None = None,
    include_target_weights: bool | None = None,
    merge_lora: bool | None = None,
) -> Path:
    """Export a run's drafter (from its newest checkpoint, or `checkpoint`); arguments left None come from the
    recipe's `export` section. `run_dir` may also be a native export (a shipped drafter), written to an engine
    format at `out`."""
    if is_native_export(run_dir):
        if out is None or checkpoint is not None or not fmt or fmt == "native":
            raise ExportError(
                f"{run_dir}: a native export; give --format (an engine format) and --out, and no --checkpoint"
            )
        recipe, target, drafter = load_native(run_dir)
    else:
        recipe, target, drafter = load_run(run_dir, checkpoint)
    fmt = fmt or recipe.export.format
    if fmt not in FORMATS:
        raise ExportError(f"export.format: {fmt!r} is not implemented yet (available: {', '.join(FORMATS)})")
    method = METHODS[recipe.drafter.method]
    if fmt not in method.formats:
        raise ExportError(
            f"export.format: {fmt} cannot hold a {method.name} drafter (its formats: {', '.join(method.formats)})"
        )
    out = Path(out or default_out(recipe, run_dir, fmt))
    if include_target_weights is None:
        include_target_weights = recipe.export.include_target_weights
    check_export_dir(out)  # before the heavy work; a directory no export wrote is never replaced
    # one export at a time into `out` (a lock file beside it: `out` itself is replaced whole), renamed into place
    # once complete: a failed export leaves nothing
    with directory_lock(out, "export", key="--out", beside=True), staged_directory(out) as tmp:
        writer = method.formats[fmt].writer
        if writer is not None:
            resolve(writer)(tmp, recipe, target, drafter, include_target_weights)
        else:
            merge = recipe.export.merge_lora if merge_lora is None else merge_lora
            ckpt = checkpoint if checkpoint is not None else latest_checkpoint(run_dir)
            steps = read_state(ckpt)["step"] if ckpt is not None else None  # for evaluation's staleness check
            write_native(tmp, recipe, target, drafter, include_target_weights, merge, run_dir, steps)
        gate_check(fmt, tmp, recipe, target, drafter)  # reloaded as its consumer does, before the rename
    return out


def write_native(
    out: Path,
    recipe: Recipe,
    target: Target,
    drafter: nn.Module,
    include_target_weights: bool,
    merge_lora: bool,
    run_dir: str | Path,
    trained_steps: int | None = None,
) -> None:
    """The native export and what comes with it: the draft vocabulary (a drafter's own, most frequent first, so that
    `eval.draft_vocab` needs no shards; else `eval.draft_vocab` / `train.loss_vocab` tokens counted in the shards, or,
    for an online run without them, in the token data it trained on), the two-stage head's factors (`eval.head:
    two_stage`), a method's extra files."""
    method = METHODS[recipe.drafter.method]
    features_dir = recipe.data.features_dir
    vocab = 0 if method.own_vocab else max(recipe.eval.draft_vocab, recipe.train.loss_vocab)
    two_stage = recipe.eval.head == "two_stage" and method.inputs == "features"  # fitted on the shards
    counts = None
    if (vocab or two_stage) and features_dir and (Path(features_dir) / "manifest.json").is_file():
        # opened (and its shards hashed) and its tokens counted once for both
        features = FeatureDataset(features_dir, verify_checksums=recipe.data.verify_checksums)
        heldout = _heldout(run_dir)  # the tokens training chose from its training split
        counts = loss_token_counts(features, vocab_size=target.config.vocab_size, skip_ids=heldout)
    elif vocab and recipe.train.online:
        counts = _online_loss_counts(recipe, target, run_dir)
    # the tensors are written once the data has been read: a missing file is named before the slow part
    save_native(out, drafter, target, recipe.to_dict(), include_target_weights, trained_steps)
    if method.own_vocab:
        save_draft_vocab(out, load_draft_vocab(run_dir))
    elif vocab and counts is not None:
        save_draft_vocab(out, most_frequent(counts, vocab))
    if two_stage and counts is not None:  # the two-stage draft heads' factors, fitted on the shards
        save_factors(out, drafter, fit_samples(features, drafter.stored_layers), counts, recipe.eval.head_rank)
    if method.export_extra:
        drafter.export_extra(out, target, merge_lora=merge_lora)


def _online_loss_counts(recipe: Recipe, target: Target, run_dir: str | Path) -> torch.Tensor:
    """Loss-token counts of the token data an online run trained on, without its held-out samples (the ids its split
    recorded are the prepared samples' ids): where its draft vocabulary comes from when it stored no shards."""
    where = f"{recipe.source}: eval.draft_vocab: counted in the run's training data"
    try:
        samples = prepare_dataset(recipe.data, target.tokenizer).samples
    except (DataError, FileNotFoundError) as exc:
        raise ExportError(f"{where}: {exc}") from None
    heldout = _heldout(run_dir)
    if heldout and set(heldout).isdisjoint(s["id"] for s in samples):
        raise ExportError(
            f"{where}: none of the run's {len(heldout)} held-out samples is in it: the run was trained on other data "
            "than its recipe names"
        )
    return loss_token_counts(samples, vocab_size=target.config.vocab_size, skip_ids=heldout)


def _heldout(run_dir: str | Path) -> list[int | str]:
    """The run's held-out sample ids (none for a run that recorded no split)."""
    try:
        return read_heldout(run_dir) or []
    except HeldoutError as exc:
        raise ExportError(str(exc)) from None


def default_out(recipe: Recipe, run_dir: str | Path, fmt: str) -> Path:
    """Where an export goes unless --out says: `export.out` for the recipe's own format, else the run directory's
    `export/` (native, what evaluation reads) or `export-<format>/`: each format has its own directory."""
    if recipe.export.out and fmt == recipe.export.format:
        return Path(recipe.export.out)
    return Path(run_dir) / ("export" if fmt == "native" else f"export-{fmt}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="train.output_dir of a run, or a native export (with --format and --out)")
    parser.add_argument(
        "--out", default=None, help="output directory (default: export.out, RUN_DIR/export or RUN_DIR/export-FORMAT)"
    )
    parser.add_argument("--format", default=None, choices=FORMATS, help="default: the recipe's export.format")
    parser.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the newest)")
    parser.add_argument("--include-target-weights", action="store_true", default=None)
    parser.add_argument("--merge-lora", action="store_true", default=None, help="LoRA drafters: also write merged/")
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.out, args.format, args.checkpoint, args.include_target_weights, args.merge_lora)
    except (
        ExportError, RecipeError, CheckpointError, FileNotFoundError, TargetError, FeatureMismatchError,
        DirectoryLocked, NotADirectory,
    ) as exc:  # fmt: skip
        sys.exit(f"error: {exc}")
    print(f"exported {args.run_dir} -> {out}")


if __name__ == "__main__":
    main()


def write_pt(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A plain dict of tensors through `torch.save` (each its own contiguous CPU copy, no module or other object),
    so `torch.load(path, weights_only=True)` reads it; written through a temporary file and a rename."""
    plain = {name: t.detach().cpu().contiguous().clone() for name, t in tensors.items()}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(plain, tmp)
    tmp.replace(path)
