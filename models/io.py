"""Exported drafters in the native format: write, read, and rebuild them strictly (no training code).

    drafter = load_drafter("runs/tiny-eagle2/export", target)  # eval's entry point

A native export is a directory with
- `config.json`: `format`, `format_version`, `method`, `drafter` (the method's config fields),
  `target` (the target's identity, `Target.identity()`), `stored_layers` (hidden-state indices the
  drafter's batches carry), `recipe` (the resolved training recipe, informational);
- `model.safetensors`: the trained drafter tensors under their module names; with
  `include_target_weights` also the frozen target tensors the drafter borrows (embedding, lm_head).
Weights are never pickled. Loading rebuilds the module from its method's declaration (`methods`) and
requires the file to hold exactly its trainable tensors; frozen tensors found in the file must equal the target's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from methods import METHODS
from models.common import borrowed_state_dict, share_safetensors
from models.target import Target, tokenizer_identity
from models.typed import build_dataclass

FORMAT = "specdraft"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
"""Optional: `token_ids` (K,) int64, the training data's K most frequent loss tokens, most frequent first; evaluation
drafts among its first `eval.draft_vocab` entries (an export carries it, so it needs no feature shards)."""
# Identity fields that must match between the training target and the one a drafter is loaded with.
# (dtype and the weight fingerprint change when the same model is loaded in another precision.)
_IDENTITY_KEYS = ("model_type", "num_layers", "hidden_size", "config_sha256")


class ExportError(ValueError):
    """An export that cannot be used with this target / code; the message names the file and field."""


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write tensors (detached, CPU, contiguous) to `path` through a temporary file and a rename, so a crash never
    leaves a partial file under the final name. Tensors that share storage (tied embeddings, heads that share
    one lm_head) are written as separate copies: safetensors refuses shared memory."""
    path = Path(path)
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size() else t
        seen.add(key)
    tmp = path.with_name(path.name + ".tmp")
    save_file(out, str(tmp))
    share_safetensors(tmp)
    tmp.replace(path)


def save_native(
    out_dir: str | Path,
    drafter: nn.Module,
    target: Target,
    recipe: dict[str, Any] | None = None,
    include_target_weights: bool = False,
    trained_steps: int | None = None,
) -> Path:
    """Write `drafter` (a method's module, trained against `target`) as a native export; `trained_steps`: the
    training step of the checkpoint it comes from, which evaluation compares with the run's newest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(drafter.trainable_state_dict())
    if include_target_weights:
        frozen = {**drafter.state_dict(), **borrowed_state_dict(drafter)}  # registered + borrowed target tensors
        tensors.update({k: v for k, v in frozen.items() if k not in tensors})
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "method": drafter.cfg.method,
        "drafter": dataclasses.asdict(drafter.cfg),
        "target": target.identity(),
        **({} if target.tokenizer is None else {"tokenizer": tokenizer_identity(target.tokenizer)}),
        "stored_layers": list(drafter.stored_layers),
        "recipe": recipe,
    }
    if trained_steps is not None:
        config["trained_steps"] = trained_steps
    write_safetensors(tensors, out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str) + "\n")
    return out


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; a missing, truncated or foreign file is an ExportError naming it."""
    if not Path(path).is_file():
        raise ExportError(f"{path}: no such file")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors' own error type, or an OSError
        raise ExportError(f"{path}: not a readable safetensors file, truncated or corrupt ({exc})") from None


def read_json(path: str | Path) -> dict[str, Any]:
    """A JSON object file; a missing, undecodable or non-object file is an ExportError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path}: no such file")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ExportError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(config, dict):
        raise ExportError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def legacy_rope(config: dict) -> dict:
    """`rope_theta` (and a legacy `rope_scaling` for scaled RoPE) beside transformers-5's `rope_parameters`:
    consumers built on transformers 4 read those and silently fall back to base 10000 without them."""
    rope = config.get("rope_parameters") or {}
    out = {"rope_theta": rope["rope_theta"]} if "rope_theta" in rope else {}
    kind = rope.get("rope_type", "default")
    if kind != "default":
        out["rope_scaling"] = {"rope_type": kind, "type": kind, **{k: v for k, v in rope.items() if k != "rope_theta"}}
    return out


def add_legacy_rope(model_dir: str | Path) -> None:
    """Write `legacy_rope`'s fields into a saved HF model directory's `config.json` (transformers 5 writes only
    `rope_parameters`), so consumers on transformers 4 build the target's RoPE and not base 10000. transformers 5
    reads the directory as before (it folds the fields into `rope_parameters`)."""
    path = Path(model_dir) / "config.json"
    config = read_json(path)
    config.update(legacy_rope(config))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


EXPORT_MARKER = ".specdraft-export"
"""Written into every directory an export or import makes, last: JSON listing every file it wrote with its sha256
(`{"written_by": ..., "files": {name: sha256}}`). Only such a directory may be replaced, and only when it holds
nothing else; whoever reads an export checks its files against it (`verify_files`)."""
SHIP_PROVENANCE = "PROVENANCE.json"
"""A shipped drafter's record (`recipes/run.py --ship`): `files_sha256` lists its files as the marker does."""
LEGACY_SUFFIXES = (".json", ".safetensors", ".pt", ".bin")
"""What exports wrote beside a marker that listed nothing (before markers listed their files)."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def listed_files(directory: str | Path) -> tuple[str, dict[str, str]] | None:
    """(the listing's file name, {file: sha256}) from an export's marker or a ship's provenance; None for a
    directory whose files nothing lists (not an export, or one written before markers listed their files)."""
    directory = Path(directory)
    for name, key in ((EXPORT_MARKER, "files"), (SHIP_PROVENANCE, "files_sha256")):
        try:
            files = json.loads((directory / name).read_text(encoding="utf-8"))[key]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
            continue
        if isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            return name, files
    return None


def verify_files(directory: str | Path) -> None:
    """Every file an export's marker (or a ship's provenance) lists is there with the sha256 it recorded; ExportError
    naming the first that is not. A directory whose files nothing lists is not checked."""
    directory = Path(directory)
    listing = listed_files(directory)
    if listing is None:
        return
    record, files = listing
    for name, digest in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise ExportError(f"{path}: missing, though {directory / record} lists it: the export is incomplete")
        if sha256_file(path) != digest:
            short = _safetensors_shortfall(path)
            how = f"truncated: {short}" if short else "changed or damaged since it was written"
            raise ExportError(
                f"{path}: its bytes are not those {directory / record} records (sha256 differs): {how}; export it again"
            )


def _safetensors_shortfall(path: Path) -> str | None:
    """'N bytes of the M its header declares' for a safetensors file cut short (an interrupted copy); None for any
    other file, or one whose header cannot be read."""
    if path.suffix != ".safetensors":
        return None
    try:
        have = path.stat().st_size
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if 8 + size > have:  # cut inside its header, or no safetensors header at all
                return f"{have:,} bytes, shorter than its own {size:,}-byte header" if size < 100_000_000 else None
            header = json.loads(f.read(size))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    need = 8 + size + max(ends, default=0)
    return f"{have:,} bytes of the {need:,} its header declares" if have < need else None


def foreign_files(path: Path) -> list[str] | None:
    """Files under `path` that no export wrote, sorted; None when `path` is not a directory an export or import of
    this project wrote (no marker, nor the config of a native export made before markers existed)."""
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() or p.is_symlink())
    listing = listed_files(path)
    if listing is not None and listing[0] == EXPORT_MARKER:
        return [f for f in files if f != EXPORT_MARKER and f not in listing[1]]
    try:
        native = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        native = False
    if not (path / EXPORT_MARKER).is_file() and not native:
        return None
    return [f for f in files if f != EXPORT_MARKER and ("/" in f or not f.endswith(LEGACY_SUFFIXES))]


def check_export_dir(out: str | Path, source: str | Path | None = None) -> None:
    """Refuse an export / import destination whose replacement could destroy something: a symbolic link, a file, a
    non-empty directory this project did not write (a model directory, a checkpoint being imported) or holding files
    it did not write beside an export (a user's notes), a leftover `<out>.tmp` or `<out>.replaced` of that kind, or
    (imports) a directory that holds or lies inside the source."""
    out = Path(out)
    if source is not None:
        src, dst = Path(source).resolve(), out.resolve()
        if dst == src or src in dst.parents or dst in src.parents:
            raise ExportError(f"--out {out}: overlaps the checkpoint being imported ({source}); choose another --out")
    for path in (out, out.with_name(out.name + ".tmp"), out.with_name(out.name + ".replaced")):
        if path.is_symlink():
            raise ExportError(f"{path}: is a symbolic link; give the directory it points to, or another --out")
        if path.exists() and not path.is_dir():
            raise ExportError(f"{path}: is a file, not a directory; choose another --out")
        if not path.is_dir() or not any(path.iterdir()):
            continue
        foreign = foreign_files(path)
        if foreign is None:
            raise ExportError(
                f"{path}: holds files no export wrote (no {EXPORT_MARKER}), which replacing it would delete; choose "
                "another --out, or delete it yourself (engine exports made before the marker existed carry none)"
            )
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise ExportError(
                f"{path}: holds {foreign[0]}{more}, which no export wrote, beside an export; replacing the directory "
                "would delete them: move them away, or choose another --out"
            )


@contextmanager
def staged_directory(out: str | Path) -> Iterator[Path]:
    """Write a directory under `<out>.tmp` and put it in place of `out` only when the block completes, with its
    marker listing every file written (an error leaves `out` as it was, an earlier export there kept, and nothing
    that looks complete). `out` and `<out>.tmp` must pass `check_export_dir` (checked again here, just before
    anything is deleted)."""
    out = Path(out)
    check_export_dir(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    marker = {"written_by": "specdraft (export.write / export.imports); a new export replaces it", "files": files}
    (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    check_export_dir(out)
    if out.exists():  # moved aside, not deleted, until the new one is in place
        old = out.with_name(out.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def read_config(export_dir: str | Path) -> dict[str, Any]:
    export_dir = Path(export_dir)
    path = export_dir / CONFIG_FILE
    if not export_dir.is_dir():
        engine = sorted(p.name for p in export_dir.parent.glob(f"{export_dir.name}-*") if p.is_dir())
        hint = (
            f"; beside it only engine layouts ({', '.join(engine)}): write the native one with "
            f"`python -m export {export_dir.parent} --format native`"
            if engine
            else " (write one with `python -m export`)"
        )
        raise ExportError(f"{export_dir}: no such drafter export directory{hint}")
    verify_files(export_dir)
    if not path.is_file():
        raise ExportError(f"{export_dir}: no {CONFIG_FILE} (not a drafter export: see `python -m export`)")
    config = read_json(path)
    if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION:
        raise ExportError(
            f"{path}: format {config.get('format')!r} v{config.get('format_version')!r}, "
            f"this code reads {FORMAT!r} v{FORMAT_VERSION} (engine formats are for serving engines, not for eval)"
        )
    if not isinstance(config.get("method"), str) or config["method"] not in METHODS:
        raise ExportError(f"{path}: method: unknown method {config.get('method')!r} (known: {sorted(METHODS)})")
    for key, kind in (("drafter", dict), ("target", dict), ("stored_layers", list)):
        if not isinstance(config.get(key), kind):
            raise ExportError(f"{path}: {key}: expected a JSON {kind.__name__}, got {config.get(key)!r:.80}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in config["stored_layers"]):
        raise ExportError(f"{path}: stored_layers: expected hidden-state indices, got {config['stored_layers']!r:.80}")
    if not isinstance(config.get("recipe"), (dict, type(None))):
        raise ExportError(f"{path}: recipe: expected a JSON object, got {config['recipe']!r:.80}")
    steps = config.get("trained_steps")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 0):
        raise ExportError(f"{path}: trained_steps: expected a step number, got {steps!r:.80}")
    return config


def check_target(config: dict[str, Any], target: Target, where: str) -> None:
    """Refuse a target other than the training one (weights compared when loaded in the same dtype)."""
    have, recorded = target.identity(), config["target"]
    same_dtype = recorded.get("dtype") == have["dtype"]
    # whole tensors where the export recorded them (exports before that: samples of every tensor)
    weights = "weights_sha256_whole" if "weights_sha256_whole" in recorded else "weights_sha256"
    pairs = [(key, recorded.get(key), have[key]) for key in _IDENTITY_KEYS + ((weights,) if same_dtype else ())]
    if isinstance(config.get("tokenizer"), dict) and target.tokenizer is not None:  # its vocabulary, chat template
        pairs += [
            (f"tokenizer.{k}", config["tokenizer"].get(k), v) for k, v in tokenizer_identity(target.tokenizer).items()
        ]
    for key, trained, loaded in pairs:
        if trained != loaded:
            raise ExportError(
                f"{where}: {'' if key.startswith('tokenizer') else 'target.'}{key}: drafter trained for {trained!r} "
                f"({recorded.get('name')}), loaded with "
                f"{loaded!r} ({have['name']})"
            )


def load_drafter(export_dir: str | Path, target: Target, check_identity: bool = True) -> nn.Module:
    """Rebuild an exported drafter on `target` (eval mode, target's device); weights load strictly."""
    config = read_config(export_dir)
    where = str(Path(export_dir) / CONFIG_FILE)
    if check_identity:
        check_target(config, target, where)
    method = METHODS[config["method"]]
    cfg_cls, module_cls = method.config, method.module()

    def err(key: str, msg: str) -> None:
        raise ExportError(f"{where}: {key}: {msg}")

    cfg = build_dataclass(cfg_cls, config["drafter"], "drafter", err)  # typed as a recipe's section, then validated
    try:
        parts = target.parts(config["stored_layers"])
    except ValueError as exc:
        raise ExportError(f"{where}: stored_layers: {exc}") from None
    try:  # what the drafter's shape rules refuse on this target (no low / mid / high layers on a small one)
        module = module_cls(cfg, parts)
    except ValueError as exc:
        raise ExportError(f"{where}: {exc}") from None
    weights = str(Path(export_dir) / WEIGHTS_FILE)
    state = read_safetensors(weights)
    expected, full = module.trainable_state_dict(), {**module.state_dict(), **borrowed_state_dict(module)}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - full.keys())
    if missing or unexpected:
        raise ExportError(f"{weights}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        want = full[name]
        if tensor.shape != want.shape:
            raise ExportError(f"{weights}: {name} has shape {tuple(tensor.shape)}, expected {tuple(want.shape)}")
        if name not in expected:  # a frozen target tensor: the target's own, compared in the narrower of the two dtypes
            narrow = min((tensor.dtype, want.dtype), key=lambda dt: torch.finfo(dt).bits)
            if not torch.equal(tensor.to(want.device, narrow), want.to(narrow)):
                raise ExportError(f"{weights}: {name} is a frozen target tensor and differs from the target's")
    module.load_state_dict({k: state[k] for k in expected}, strict=False)
    place_on_target(module, target)
    offloaded = [name for name, t in module.trainable_state_dict().items() if t.is_meta]
    if offloaded:  # load_state_dict writes nothing into meta tensors: these would stay untrained
        raise ExportError(
            f"{weights}: {offloaded[0]} and {len(offloaded) - 1} more tensors sit on target layers kept offloaded "
            "(a device_map with 'cpu' or 'disk' entries beside GPUs leaves their weights on the meta device), where "
            "they cannot be loaded: place every layer on a device (target.device_map, max_memory)"
        )
    return module.eval()


def place_on_target(module: nn.Module, target: Target) -> None:
    """Move `module`'s own tensors to the target's device and leave the target's tensors where the target put them.

    A drafter that registers target modules (Medusa-2's LoRA backbone is the target's own layers) must not move
    them: a `target.device_map` spreads them over GPUs, and `.to()` would gather the whole target on one. An own
    tensor inside a module that also holds target tensors (a LoRA adapter beside its base layer) goes to that
    module's device, every other one (heads, drafter layers) to `target.device`.
    """
    shared = {id(t) for t in (*target.model.parameters(), *target.model.buffers())}

    def first_shared(sub: nn.Module) -> torch.Tensor | None:
        return next((t for t in (*sub.parameters(), *sub.buffers()) if id(t) in shared), None)

    def place(sub: nn.Module, device: torch.device, top: bool) -> None:
        held = first_shared(sub)
        if held is None:
            sub.to(device)  # nothing of the target's below: the whole subtree is the drafter's
            return
        if not top:  # the nearest module holding target tensors decides (a LoRA wrapper: its base layer's device)
            device = held.device
        with torch.no_grad():
            for p in sub.parameters(recurse=False):
                if id(p) not in shared:
                    p.data = p.data.to(device)
            for name, b in sub.named_buffers(recurse=False):
                if id(b) not in shared:
                    sub._buffers[name] = b.to(device)
        for child in sub.children():
            place(child, device, top=False)

    place(module, target.device, top=True)


def save_draft_vocab(directory: str | Path, token_ids: torch.Tensor) -> None:
    write_safetensors({"token_ids": token_ids.to(torch.int64)}, Path(directory) / DRAFT_VOCAB_FILE)


def draft_vocab_sha256(token_ids: torch.Tensor) -> str:
    """What a checkpoint records of the draft vocabulary its head rows belong to: the sha256 of the ids in order."""
    return hashlib.sha256(token_ids.to(torch.int64).cpu().contiguous().numpy().tobytes()).hexdigest()


def load_draft_vocab(directory: str | Path) -> torch.Tensor | None:
    """The export's draft vocabulary (K,) int64, or None when it has none."""
    path = Path(directory) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = load_file(str(path))["token_ids"]
    except Exception as exc:  # a truncated or foreign file
        raise ExportError(f"{path}: not a draft vocabulary file ({type(exc).__name__}: {exc})") from None
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ExportError(f"{path}: token_ids must be a 1-D int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
    return ids
