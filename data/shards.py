"""Feature shards: the on-disk format written by `data.extract` and read by offline training.

    ds = FeatureDataset("runs/features", expect={"layers": [-1]})  # checks every shard's sha256 at open
    sample = ds[0]  # {"id", "input_ids" (T,), "loss_mask" (T,), "hidden" (T, n_layers, d)}

A feature directory holds `manifest.json` and `shard-00000.safetensors`, ... A shard
packs its samples end to end: `input_ids [T] int32`, `loss_mask [T] uint8`, `hidden [T, n·d]`
(storage dtype, bf16 by default), `offsets [n+1] int64` and `sample_ids [n] int64`. Shards and the
manifest are written to a `.tmp` name and renamed, so a file under its final name is complete.
Encoded storage (`data.storage_dtype` fp8_e4m3 or pca, `data.codecs`) stores `hidden` as its codes plus
`hidden_scale [T, n]`, and pca a per-layer basis once beside the shards (`basis.safetensors`); readers decode to
float32 (`FeatureDataset.__getitem__`, or `data.loader.BatchLoader` a whole batch on the training device).

The manifest carries a *header* (format version, target identity, layer indices, hidden size,
storage dtype, template fingerprint) that readers and resumed extractions compare against what
they expect, plus per-shard sha256, size, sample ids and lengths, and totals. An encoded feature set's manifest
has format version 2 (older readers refuse it by that number) and an `encoding` record: the encoding's settings and,
for pca, the basis file's name, sha256 and size, checked like a shard's. It names its shards by
bare file name: an entry naming a path (`../x`, `/abs/x`, `sub/x`) is refused. A shard whose size or
sha256 differs from its entry (bit rot, an edit, another run's shard), or that is a symbolic link to a file
outside the directory, is refused by readers, naming the shard, and extracted again by a re-run of `data.extract`
(which replaces the link, not what it points to).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from data.codecs import BASIS_FILE, ENCODINGS, PLAIN_DTYPES, Codec, PcaCodec, make_codec
from data.files import durable_replace, file_sha256, write_json_atomic
from models.common import share_safetensors

FORMAT_VERSION = 1
ENCODED_FORMAT_VERSION = 2
"""The format version of feature sets with an encoded storage dtype (readers before encodings refuse them)."""
MANIFEST = "manifest.json"
HEADER_KEYS = ("format_version", "target", "layers", "hidden_size", "dtype", "template")
STORAGE_DTYPES: dict[str, torch.dtype] = PLAIN_DTYPES
"""The plain storage dtypes; `data.codecs.ENCODINGS` names the encoded ones."""


def format_version(dtype: str) -> int:
    return ENCODED_FORMAT_VERSION if dtype in ENCODINGS else FORMAT_VERSION


REPAIR = "re-run `python -m data.extract RECIPE` to repair it"
"""What to do about a shard that is not what its manifest says: extraction re-extracts exactly such shards."""


class FeatureMismatchError(ValueError):
    """Features on disk are not what the reader expects: built with different settings (the message names the
    field), a manifest entry that is not a bare file name, or a shard that differs from its manifest entry (the
    message names the shard and the manifest)."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def is_bare_name(name: Any) -> bool:
    """A file name without any directory part: manifests may only name files in their own directory."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


_INTS = "a list of integers"
MANIFEST_TYPES: dict[str, type | str] = {
    "format_version": int, "target": dict, "layers": _INTS, "hidden_size": int, "dtype": str, "num_samples": int,
    "num_tokens": int, "shards": list,
}  # fmt: skip
"""The manifest fields every reader relies on, and their JSON types."""
SHARD_TYPES: dict[str, type | str] = {
    "index": int, "file": str, "sha256": str, "bytes": int, "num_samples": int, "num_tokens": int,
    "sample_ids": _INTS, "lengths": _INTS,
}  # fmt: skip


def _type_problem(value: Any, want: type | str) -> bool:
    if want == _INTS:
        return not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
    return not isinstance(value, want) or (want is int and isinstance(value, bool))


def check_manifest_types(manifest: Any, path: Path) -> None:
    """FeatureMismatchError naming the manifest and the field when it is not what extraction writes: an object with
    the fields of MANIFEST_TYPES, and shard entries with those of SHARD_TYPES (an edited or foreign file)."""
    if not isinstance(manifest, dict):
        raise FeatureMismatchError(f"{path}: not a feature manifest (a JSON object), got {type(manifest).__name__}")
    checks = [(key, manifest.get(key), want) for key, want in MANIFEST_TYPES.items()]
    for i, entry in enumerate(manifest["shards"] if isinstance(manifest.get("shards"), list) else []):
        if not isinstance(entry, dict):
            raise FeatureMismatchError(f"{path}: shards[{i}]: not a shard entry (a JSON object)")
        checks += [(f"shards[{i}].{key}", entry.get(key), want) for key, want in SHARD_TYPES.items()]
    for key, value, want in checks:
        if _type_problem(value, want):
            name = want if isinstance(want, str) else f"a JSON {'number' if want is int else want.__name__}"
            raise FeatureMismatchError(f"{path}: {key}: expected {name}, got {value!r:.60}")


def check_shard_names(manifest: dict[str, Any], where: str | Path) -> None:
    """Refuse (FeatureMismatchError naming `where` and the entry) shard entries whose file is not a bare name,
    before anything is opened: a manifest that points outside its directory is never followed."""
    for position, entry in enumerate(manifest.get("shards", [])):
        name = entry.get("file") if isinstance(entry, dict) else None
        if not is_bare_name(name):
            raise FeatureMismatchError(
                f"{where}: shards[{position}] names file {name!r}; a feature manifest names its shards by bare "
                "file name in its own directory (no '..', '/' or absolute path): refusing it"
            )


def shard_problem(
    path: Path,
    entry: dict[str, Any],
    verify_checksums: bool = True,
    manifest: str | Path = "the manifest",
    what: str = "shard",
) -> str | None:
    """How the file at `path` differs from its `manifest` entry (missing, another size, another sha256, a symbolic
    link out of its directory), or None. `what` names the kind of file in the message (a shard, a basis)."""
    if not path.is_file():
        return f"missing, listed in {manifest}"
    if path.is_symlink() and not path.resolve().is_relative_to(path.parent.resolve()):
        return (
            f"a symbolic link to {path.resolve()}, outside {path.parent}: a feature directory's {what}s are its own "
            "files, and one outside it is not read"
        )
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{size} bytes where {manifest} says {entry['bytes']}: a truncated, edited or foreign {what}"
    if verify_checksums and (digest := file_sha256(path)) != entry["sha256"]:
        return (
            f"sha256 {digest[:12]}... where {manifest} says {entry['sha256'][:12]}...: "
            f"a corrupted, edited or foreign {what}"
        )
    return None


def write_shard(
    directory: str | Path,
    index: int,
    sample_ids: Sequence[int],
    lengths: Sequence[int],
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden: torch.Tensor | dict[str, torch.Tensor],
) -> dict[str, Any]:
    """Write one shard from flat tensors (samples end to end); return its manifest entry.

    input_ids, loss_mask: (T,); hidden: (T, n_layers·d) already in the storage dtype, or an encoding's tensors
    (`Codec.encode`: {"hidden": (T, ...), "hidden_scale": (T, n)}).
    """
    T = int(sum(lengths))
    parts = hidden if isinstance(hidden, dict) else {"hidden": hidden}
    if (
        input_ids.shape != (T,) or loss_mask.shape != (T,) or any(p.shape[0] != T for p in parts.values())
        or parts["hidden"].dim() != 2
    ):  # fmt: skip
        raise ValueError(f"shard {index}: tensors do not match {len(lengths)} samples of {T} tokens in total")
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int64), 0)
    tensors = {
        "input_ids": input_ids.to(torch.int32).contiguous(),
        "loss_mask": loss_mask.to(torch.uint8).contiguous(),
        **{name: part.contiguous() for name, part in parts.items()},
        "offsets": offsets,
        "sample_ids": torch.tensor(list(sample_ids), dtype=torch.int64),
    }
    final = Path(directory) / shard_name(index)
    tmp = final.with_name(final.name + ".tmp")
    save_file(tensors, str(tmp))
    share_safetensors(tmp)
    entry = {
        "file": final.name,
        "index": index,
        "sha256": file_sha256(tmp),
        "bytes": tmp.stat().st_size,
        "num_samples": len(lengths),
        "num_tokens": T,
        "sample_ids": [int(i) for i in sample_ids],
        "lengths": [int(n) for n in lengths],
    }
    durable_replace(tmp, final)  # on disk before the caller records the entry
    return entry


def build_manifest(header: dict[str, Any], entries: list[dict[str, Any]], extra: dict | None = None) -> dict:
    """The manifest: header, totals (samples, tokens, bytes, bytes per token) and shard entries by index.

    Bytes count every file of the feature set: the shards and an encoding's basis file (`encoding.basis_bytes`).
    `hidden_bytes_per_token` is the shards' hidden states per token (an encoding's scales included)."""
    entries = sorted(entries, key=lambda e: e["index"])
    num_tokens = sum(e["num_tokens"] for e in entries)
    encoding = header.get("encoding")
    total_bytes = sum(e["bytes"] for e in entries) + (encoding or {}).get("basis_bytes", 0)
    if encoding is None:
        hidden_bytes = len(header["layers"]) * header["hidden_size"] * STORAGE_DTYPES[header["dtype"]].itemsize
    else:
        hidden_bytes = encoding["payload_bytes"]
    return {
        **{key: header[key] for key in HEADER_KEYS},
        **({} if encoding is None else {"encoding": encoding}),
        "num_samples": sum(e["num_samples"] for e in entries),
        "num_tokens": num_tokens,
        "total_bytes": total_bytes,
        "bytes_per_token": total_bytes / max(num_tokens, 1),
        "hidden_bytes_per_token": hidden_bytes,
        **(extra or {}),
        "shards": entries,
    }


LATER_TARGET_KEYS = ("weights_sha256_whole",)
"""Target identity fields that features extracted before they existed do not record: compared when recorded."""


def check_header(found: dict[str, Any], expect: dict[str, Any], where: str) -> None:
    """Raise FeatureMismatchError naming the first field of `expect` that `found` disagrees with.

    Mappings (target identity, data sources) are compared field by field and the message names the field; a
    target's `name` is not compared (a moved model is the same model).
    """
    for key, want in expect.items():
        have = found.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            for sub, sub_want in want.items():
                if key == "target" and (sub == "name" or (sub in LATER_TARGET_KEYS and sub not in have)):
                    continue
                if have.get(sub) != sub_want:
                    named = f" (target {have.get('name')!r} vs {want.get('name')!r})" if key == "target" else ""
                    raise FeatureMismatchError(
                        f"{where}: built with {key}.{sub}={have.get(sub)!r}, expected {sub_want!r}{named}"
                    )
        elif have != want:
            raise FeatureMismatchError(f"{where}: built with {key}={have!r}, expected {want!r}")


def write_basis(directory: str | Path, codec: PcaCodec, fitted_for: str | None = None) -> dict[str, Any]:
    """Write a fitted codec's basis as `BASIS_FILE` in `directory` (temporary name, fsync, rename: on disk before any
    shard that uses it) and return the manifest's `encoding` record: settings, file, sha256, bytes."""
    final = Path(directory) / BASIS_FILE
    tmp = final.with_name(final.name + ".tmp")
    codec.save(tmp, fitted_for)
    share_safetensors(tmp)
    record = {**codec.params(), "basis": final.name, "basis_sha256": file_sha256(tmp)}
    record["basis_bytes"] = tmp.stat().st_size
    durable_replace(tmp, final)
    return record


def feature_codec(
    directory: str | Path, manifest: dict[str, Any], verify_checksums: bool = True, where: str | Path = "the manifest"
) -> Codec:
    """The codec that decodes a feature set: its storage dtype's, or for pca the basis file its `encoding` names,
    checked like a shard (size, and sha256 unless `verify_checksums` is false): a FeatureMismatchError (or
    FileNotFoundError) names the file and the manifest."""
    dtype, n, d = manifest["dtype"], len(manifest["layers"]), manifest["hidden_size"]
    if dtype not in PLAIN_DTYPES and dtype not in ENCODINGS:
        raise FeatureMismatchError(f"{where}: dtype {dtype!r} is no storage dtype this code reads")
    if dtype != "pca":
        return make_codec(dtype, n, d)
    encoding = manifest.get("encoding") or {}
    name = encoding.get("basis")
    if not is_bare_name(name) or not isinstance(encoding.get("basis_bytes"), int):
        raise FeatureMismatchError(f"{where}: encoding.basis names file {name!r}; a pca feature set names its basis by "
                                   "bare file name, with its size and sha256")  # fmt: skip
    path = Path(directory) / name
    entry = {"bytes": encoding["basis_bytes"], "sha256": encoding.get("basis_sha256")}
    problem = shard_problem(path, entry, verify_checksums, where, what="basis")
    if problem is not None:
        error = FeatureMismatchError if path.is_file() else FileNotFoundError
        raise error(f"{path}: {problem}; {REPAIR}")
    try:
        codec, _ = PcaCodec.load(path)
    except Exception as exc:  # a file of the right size that is no basis (checksums off)
        raise FeatureMismatchError(f"{path}: not a readable basis ({exc.__class__.__name__}); {REPAIR}") from None
    if (codec.n_layers, codec.hidden_size, codec.bytes_per_token) != (n, d, encoding.get("payload_bytes")):
        raise FeatureMismatchError(
            f"{path}: a basis for {codec.n_layers} layers of {codec.hidden_size} values in {codec.bytes_per_token} "
            f"bytes, where {where} says {n} of {d} in {encoding.get('payload_bytes')}; {REPAIR}"
        )
    return codec


class FeatureShardWriter:
    """Streams samples into shards of about `shard_tokens` tokens, then writes the manifest.

    A shard closes at the first sample boundary at or past `shard_tokens`. `data.extract` plans its
    shards up front instead (for resumability) and calls `write_shard` directly. An encoded `header["dtype"]` encodes
    each sample (`codec`: a fitted PcaCodec for pca, whose basis is written first; made from the dtype otherwise).
    """

    def __init__(self, directory: str | Path, header: dict[str, Any], shard_tokens: int, codec: Codec | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.header = {"format_version": format_version(header["dtype"]), **header}
        n, d = len(self.header["layers"]), self.header["hidden_size"]
        self.codec = codec if codec is not None else make_codec(self.header["dtype"], n, d)
        if self.codec.name != self.header["dtype"]:
            raise ValueError(f"a {self.codec.name} codec for features stored as {self.header['dtype']}")
        if isinstance(self.codec, PcaCodec):
            self.header["encoding"] = write_basis(self.directory, self.codec)
        elif self.codec.encoded:
            self.header["encoding"] = self.codec.params()
        self.shard_tokens = shard_tokens
        self.entries: list[dict[str, Any]] = []
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = []
        self._pending_tokens = 0

    def add(self, sample_id: int, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: torch.Tensor) -> None:
        """One sample: input_ids, loss_mask (T,); hidden (T, n_layers, d)."""
        T, n, d = hidden.shape
        if n != len(self.header["layers"]) or d != self.header["hidden_size"] or input_ids.shape != (T,):
            raise ValueError(f"sample {sample_id}: hidden {tuple(hidden.shape)} does not match the header")
        self._pending.append((sample_id, input_ids, loss_mask, self.codec.encode(hidden)))
        self._pending_tokens += T
        if self._pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        ids, tokens, masks, parts = zip(*self._pending)
        entry = write_shard(
            self.directory,
            len(self.entries),
            ids,
            [len(t) for t in tokens],
            torch.cat(tokens),
            torch.cat(masks),
            {name: torch.cat([p[name] for p in parts]) for name in parts[0]},
        )
        self.entries.append(entry)
        self._pending, self._pending_tokens = [], 0

    def close(self, extra: dict | None = None) -> dict[str, Any]:
        """Write the last shard and the manifest; return the manifest."""
        self.flush()
        manifest = build_manifest(self.header, self.entries, extra)
        write_json_atomic(self.directory / MANIFEST, manifest)
        return manifest


def read_json_file(path: Path, what: str) -> Any:
    """A JSON file this package wrote, or a FeatureMismatchError naming it (a torn or edited copy)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FeatureMismatchError(f"{path}: not a readable {what} ({exc.__class__.__name__}: {exc})") from None


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {MANIFEST} (run `python -m data.extract RECIPE` first)")
    manifest = read_json_file(path, "feature manifest (delete the directory and extract again)")
    check_manifest_types(manifest, path)
    if manifest.get("format_version") not in (FORMAT_VERSION, ENCODED_FORMAT_VERSION):
        raise FeatureMismatchError(
            f"{path}: format_version {manifest.get('format_version')!r}, this code reads {FORMAT_VERSION} and "
            f"{ENCODED_FORMAT_VERSION}"
        )
    check_shard_names(manifest, path)
    return manifest


def split_by_id(sample_ids: Sequence[int], heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, heldout) positions: the round(fraction·n) samples with the smallest id hash.

    Depends on ids only, so the split is the same however the samples are sharded or ordered.
    """
    if heldout_fraction <= 0 or not sample_ids:
        return list(range(len(sample_ids))), []
    rank = sorted(range(len(sample_ids)), key=lambda i: hashlib.sha256(f"{seed}:{sample_ids[i]}".encode()).digest())
    n_heldout = min(max(1, round(heldout_fraction * len(sample_ids))), len(sample_ids) - 1)
    heldout = set(rank[:n_heldout])
    return [i for i in range(len(sample_ids)) if i not in heldout], sorted(heldout)


class FeatureDataset:
    """Random access to the samples of a feature directory, shards memory-mapped lazily (small LRU).

    `expect` maps header fields (see HEADER_KEYS) to required values, e.g. `{"target": target.identity(),
    "layers": [-1]}`; a mismatch raises FeatureMismatchError naming the field. Every shard's size is checked
    against the manifest at open, and with `verify_checksums` (the default) its sha256 too, once per shard: at
    open rather than at first read, because an epoch reads every shard anyway (hashing costs the same CPU either
    way: measured within a few percent of each other), and a bad shard then stops a run before any work, with one
    line naming the shard and the manifest (FeatureMismatchError). `verify_shards=(rank, world_size)` hashes only
    shards rank, rank + world_size, ...: N training processes each hash 1/N of the shards (every shard once over
    all of them) and share their verdicts (`train.loop.build_loaders`); sizes are still checked for every shard.
    `benchmarks/train_step.py` measures the hashing against an epoch of training.
    """

    def __init__(
        self,
        directory: str | Path,
        verify_checksums: bool = True,
        expect: dict[str, Any] | None = None,
        max_open_shards: int = 8,
        verify_shards: tuple[int, int] = (0, 1),
    ) -> None:
        rank, world_size = verify_shards
        if not 0 <= rank < world_size:
            raise ValueError(f"verify_shards={verify_shards!r}: want (rank, world_size) with 0 <= rank < world_size")
        self.directory = Path(directory)
        self.manifest = read_manifest(directory)
        manifest_path = self.directory / MANIFEST
        check_header(self.manifest, expect or {}, str(manifest_path))
        self.layers: list[int] = self.manifest["layers"]
        self.hidden_size: int = self.manifest["hidden_size"]
        self.codec = feature_codec(self.directory, self.manifest, verify_checksums, manifest_path)
        self.dtype = self.codec.dtype  # what samples carry: the storage dtype, or float32 decoded
        self.shards: list[dict[str, Any]] = self.manifest["shards"]
        # sizes of all shards first (cheap), then the hashes: a missing last shard fails before hashing the others
        for verify in (False, True) if verify_checksums else (False,):
            for entry in self.shards[rank::world_size] if verify else self.shards:
                path = self.directory / entry["file"]
                problem = shard_problem(path, entry, verify, manifest_path)
                if problem is not None:
                    error = FeatureMismatchError if path.is_file() else FileNotFoundError
                    raise error(f"{path}: {problem}; {REPAIR}")
        # position i -> (shard, first token, length); token starts are prefix sums of the lengths
        self.sample_ids: list[int] = []
        self.lengths: list[int] = []
        self._where: list[tuple[int, int]] = []
        for s, entry in enumerate(self.shards):
            start = 0
            for sample_id, length in zip(entry["sample_ids"], entry["lengths"]):
                self.sample_ids.append(sample_id)
                self.lengths.append(length)
                self._where.append((s, start))
                start += length
        self._open: OrderedDict[int, Any] = OrderedDict()
        self.max_open_shards = max_open_shards
        self._lock = threading.Lock()  # one reader at a time: a loader reads ahead on a thread
        self.statistics: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def attach_statistics(self, stats: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Per shard, the target's top-1 ids and logsumexp over its tokens (`data.target_stats`): every sample then
        carries them as `target_top1` / `target_lse`."""
        if len(stats) != len(self.shards):
            raise ValueError(f"{self.directory}: statistics for {len(stats)} shards, the set has {len(self.shards)}")
        self.statistics = stats

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _handle(self, s: int) -> Any:
        if s in self._open:
            self._open.move_to_end(s)
            return self._open[s]
        handle = safe_open(str(self.directory / self.shards[s]["file"]), framework="pt")
        offsets = handle.get_tensor("offsets")
        if offsets[-1].item() != self.shards[s]["num_tokens"] or len(offsets) != self.shards[s]["num_samples"] + 1:
            raise FeatureMismatchError(
                f"{self.directory / self.shards[s]['file']}: offsets disagree with {self.directory / MANIFEST} "
                f"(a corrupted shard); {REPAIR}"
            )
        self._open[s] = handle
        if len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return handle

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Sample i: `hidden` (T, n, d) in the storage dtype, or decoded to float32 (on the CPU) when encoded."""
        item = self.encoded(i)
        item["hidden"] = self.codec.decode(item.pop("parts"))  # (T, n, d)
        return item

    def encoded(self, i: int) -> dict[str, Any]:
        """Sample i as stored: `parts`, the shard's hidden-state tensors of its T tokens (`Codec.tensors`), read
        through the memory map, for a reader that decodes many samples at once (`data.loader.BatchLoader`)."""
        s, start = self._where[i]
        end = start + self.lengths[i]
        with self._lock:
            handle = self._handle(s)
            item = {
                "id": self.sample_ids[i],
                "input_ids": handle.get_slice("input_ids")[start:end].to(torch.int64),  # (T,)
                "loss_mask": handle.get_slice("loss_mask")[start:end].to(torch.float32),  # (T,)
                "parts": {name: handle.get_slice(name)[start:end] for name in self.codec.tensors},
            }
        if self.statistics is not None:
            top1, lse = self.statistics[s]
            item["target_top1"], item["target_lse"] = top1[start:end], lse[start:end]  # (T,) each
        return item

    def split(self, heldout_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
        """(train, heldout) positions, deterministic by sample id hash (see `split_by_id`)."""
        return split_by_id(self.sample_ids, heldout_fraction, seed)
