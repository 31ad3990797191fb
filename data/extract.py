"""Run the frozen target over the prepared dataset and store its hidden states as feature shards.

    accelerate launch -m data.extract RECIPE [key=value ...]
    python -m data.extract RECIPE [key=value ...]

The shard plan (which samples go into which shard) is computed up front from the prepared data:
samples sorted by length, cut into shards of about `data.shard_tokens` tokens, shard k owned by
process k % world_size. It does not depend on the number of processes, so any number of processes
produces the same shards. Inside a shard, samples are batched by length up to
`data.extract_batch_tokens` padded tokens.

Resume: each process records its finished shards in `manifest.part-RRRRR.json` (atomically, after
every shard); a re-run skips shards that are present, recorded and intact (size and sha256 as recorded,
unless `data.verify_checksums: false`), and a killed-then-resumed run ends with the same shards and
manifest, byte for byte, as an uninterrupted one. A damaged, edited or foreign shard is therefore
extracted again (exactly that shard), which repairs a directory that training refused. When every
process is done, process 0 merges the parts into `manifest.json`. Existing features built with
another target, layer set, storage dtype, template or data refuse to be extended (the error names
the field). The resolved recipe is saved as `recipe.yaml` next to the features.

Encoded storage (`data.storage_dtype`: fp8_e4m3, pca; `data.codecs`) is encoded on the target's device before the
copy to the host. pca first fits its per-layer basis on `data.storage_fit_tokens` tokens of samples spread evenly
over the (length-sorted) plan, one extra forward over them on process 0, and writes it as `basis.safetensors`
(temporary name, fsync, rename) before any shard; the parts and the manifest record its sha256. A resumed run
reuses the basis when it is the one the recorded shards name (the fit is deterministic: a lost or damaged basis is
fitted again, and shards recorded with another basis are extracted again), and encoding settings that differ
(`data.storage_bits`, `data.storage_fit_tokens`) are refused like another dtype, naming `encoding.<field>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from data.codecs import BASIS_FILE, FITTED_KEYS, Codec, PcaCodec, encoding_settings, make_codec
from data.engines import EngineError, add_engine_options, engine_options
from data.files import file_sha256, write_json_atomic
from data.prepare import PreparedData, TokenSample, data_sources, prepare_dataset, template_fingerprint
from data.shards import (
    HEADER_KEYS,
    MANIFEST,
    FeatureMismatchError,
    build_manifest,
    check_header,
    check_shard_names,
    format_version,
    read_json_file,
    shard_name,
    shard_problem,
    write_basis,
    write_shard,
)
from models.host import keep_freed_memory
from models.target import Target, load_placed_target
from rundir.lock import DirectoryLocked, lock_for_all

if TYPE_CHECKING:  # schema.recipe pulls in every drafter; extraction needs none of them
    from schema.sections import DataConfig
from data.extract_plan import fit_positions, length_batches, plan_sha256, plan_shards

STOP_AFTER_ENV = "SPECDRAFT_EXTRACT_STOP_AFTER_SHARDS"
"""Test hook: every process exits (code 3) once each has written this many shards, as if killed."""
PART_GLOB = "manifest.part-*.json"


def part_name(rank: int) -> str:
    return f"manifest.part-{rank:05d}.json"


def feature_identity(target: Target, data: DataConfig) -> dict[str, Any]:
    """The header fields that say which features a directory holds: target identity, stored layers, template
    fingerprint (when the target has a tokenizer), max_len and data sources. Extraction writes them (with the
    storage details) and offline training expects them, so features built with other settings are refused."""
    return {"target": target.identity(), **data_identity(data, target.tokenizer)}


def data_identity(data: DataConfig, tokenizer) -> dict[str, Any]:
    """`feature_identity` without the target's: what can be checked with only the tokenizer loaded."""
    return {
        "layers": list(data.layers),
        **({} if tokenizer is None else {"template": template_fingerprint(tokenizer)}),
        "max_len": data.max_len,
        "sources": data_sources(data),
    }


class ExtractError(ValueError):
    """Features that cannot be stored as asked; the message names the setting and the sample."""


def _check_finite(stored: torch.Tensor, samples: list[TokenSample], storage: str) -> None:
    """Refuse a batch whose hidden states hold inf or nan (float16 overflows above 65504), naming a sample. `stored`:
    (tokens, ...) the stored values, or for an encoding the float states it encodes."""
    finite = torch.isfinite(stored.reshape(len(stored), -1)).all(-1)  # (tokens,)
    if bool(finite.all()):
        return
    bad = int((~finite).nonzero()[0])
    sample = next(
        s for s, stop in zip(samples, itertools.accumulate(len(s["input_ids"]) for s in samples)) if bad < stop
    )
    hint = " (float16 overflows where the target's activations exceed 65504: use bfloat16)" if (
        storage == "float16") else ""  # fmt: skip
    raise ExtractError(f"data.storage_dtype: sample {sample['id']} has non-finite hidden states in {storage}{hint}")


def extract_shard(
    target: Target,
    samples: list[TokenSample],
    layers: list[int],
    codec: Codec,
    batch_tokens: int,
    on_batch: Callable[[int, int], None] = lambda n, t: None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Flat (input_ids (T,), loss_mask (T,), the codec's hidden tensors {"hidden": (T, ...), ...}) for samples sorted
    by ascending length. Plain storage casts on the device; an encoding encodes there (only its bytes cross)."""
    lengths = [len(s["input_ids"]) for s in samples]
    n, d = len(layers), target.hidden_size
    parts = {name: torch.empty(sum(lengths), *shape, dtype=dtype) for name, (shape, dtype) in
             codec.part_shapes().items()}  # filled batch by batch  # fmt: skip
    offset = 0
    for start, end in length_batches(lengths, batch_tokens):
        T, batch_start = lengths[end - 1], offset
        ids = torch.zeros(end - start, T, dtype=torch.long)  # right padding (pad id irrelevant: causal + mask)
        mask = torch.zeros(end - start, T, dtype=torch.long)
        for row, s in enumerate(samples[start:end]):
            ids[row, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
            mask[row, : len(s["input_ids"])] = 1
        with torch.inference_mode():
            h = target.hidden_states(ids.to(target.device), mask.to(target.device), layers=layers)  # (B, T, n, d)
        if not codec.encoded:
            h = h.reshape(end - start, T, n * d)
            if h.device.type != "cpu":  # cast before the transfer: half the bytes over the bus
                h = h.to(codec.dtype).cpu()
            hidden = parts["hidden"]
            if lengths[start] == T:  # no padding (common: samples are length-sorted): one cast-and-copy
                hidden[offset : offset + (end - start) * T].copy_(h.reshape(-1, n * d))
                offset += (end - start) * T
            else:
                for row, length in enumerate(lengths[start:end]):
                    hidden[offset : offset + length].copy_(h[row, :length])
                    offset += length
            _check_finite(hidden[batch_start:offset], samples[start:end], codec.name)
        else:
            if lengths[start] == T:
                rows = h.reshape(-1, n, d)
            else:
                rows = torch.cat([h[row, :length] for row, length in enumerate(lengths[start:end])])
            _check_finite(rows, samples[start:end], codec.name)
            offset += len(rows)
            for name, part in codec.encode(rows).items():
                parts[name][batch_start:offset].copy_(part)
        on_batch(end - start, sum(lengths[start:end]))
    input_ids = torch.tensor([t for s in samples for t in s["input_ids"]], dtype=torch.int32)
    loss_mask = torch.tensor([m for s in samples for m in s["loss_mask"]], dtype=torch.uint8)
    return input_ids, loss_mask, parts


def fit_basis(
    target: Target, samples: list[TokenSample], plan: list[list[int]], header: dict[str, Any], batch_tokens: int
) -> PcaCodec:
    """A pca codec fitted on the hidden states of `fit_positions` (one forward over them, float32 on the host)."""
    encoding = header["encoding"]
    fit = [samples[i] for i in fit_positions(samples, plan, encoding["fit_tokens"])]
    n, d = len(header["layers"]), header["hidden_size"]
    _, _, parts = extract_shard(target, fit, header["layers"], make_codec("float32", n, d), batch_tokens)
    return PcaCodec.fit(parts["hidden"].view(-1, n, d), encoding["bits"], encoding["fit_tokens"])


def _settings(header: dict[str, Any]) -> dict[str, Any]:
    """The header without what a fit produced (`FITTED_KEYS` of `encoding`): what a resumed run compares first."""
    if "encoding" not in header:
        return header
    return {**header, "encoding": {k: v for k, v in header["encoding"].items() if k not in FITTED_KEYS}}


def _recorded_bases(directory: Path) -> set[str]:
    """The basis sha256s that the manifest and parts in `directory` record for their shards."""
    found = set()
    for path in [directory / MANIFEST, *sorted(directory.glob(PART_GLOB))]:
        if path.is_file():
            record = read_json_file(path, "manifest")
            sha = (record.get("header", record).get("encoding") or {}).get("basis_sha256")
            if sha is not None and record.get("shards"):
                found.add(sha)
    return found


def _resolve_basis(target: Target, samples: list[TokenSample], plan: list[list[int]], directory: Path,
                   header: dict[str, Any], batch_tokens: int) -> None:  # fmt: skip
    """Process 0: leave in `directory` the basis this extraction encodes with. An existing basis is kept when it was
    fitted for these settings (`fit_key`) and is the one the recorded shards name (or none are recorded); otherwise
    (none, torn, damaged, another extraction's) it is fitted again, durably, before any shard."""
    path = directory / BASIS_FILE
    recorded = _recorded_bases(directory)
    if path.is_file():
        try:
            _, meta = PcaCodec.load(path)
            if meta.get("fitted_for") == fit_key(header) and (not recorded or file_sha256(path) in recorded):
                return
        except Exception:  # a torn or foreign file: fitted again below
            pass
        print(f"{path}: not this extraction's basis or its shards; fitting it again", file=sys.stderr, flush=True)
    write_basis(directory, fit_basis(target, samples, plan, header, batch_tokens), fit_key(header))


def fit_key(header: dict[str, Any]) -> str:
    """What a basis is fitted for: a hash of the extraction's settings (target, layers, data, plan, encoding
    settings), recorded in the basis file, so that a basis left by another extraction is never reused."""
    settings = {key: value for key, value in _settings(header).items() if value is not None}  # as before `engine`
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _known_entries(directory: Path, header: dict[str, Any]) -> dict[int, dict]:
    """Shard entries recorded by earlier runs (manifest and parts), after checking they were built alike."""
    known: dict[int, dict] = {}
    basis = header.get("encoding", {}).get("basis_sha256")
    for path in [directory / MANIFEST, *sorted(directory.glob(PART_GLOB))]:
        if not path.is_file():
            continue
        what = "manifest" if path.name == MANIFEST else "part manifest (delete it to extract its shards again)"
        record = read_json_file(path, what)
        found = record.get("header", record)
        try:
            check_header(found, _settings(header), str(path))
        except FeatureMismatchError as exc:
            raise FeatureMismatchError(f"{exc}; use another data.features_dir or delete {directory}") from None
        if basis is not None and (found.get("encoding") or {}).get("basis_sha256") != basis:
            if record.get("shards"):
                print(f"{path}: shards encoded with another basis; extracting them again", file=sys.stderr, flush=True)
            continue
        try:
            check_shard_names(record, path)
        except FeatureMismatchError as exc:
            raise FeatureMismatchError(f"{exc} (delete {path} to extract from scratch)") from None
        for entry in record.get("shards", []):
            known[entry["index"]] = entry
    return known


def _is_complete(directory: Path, entry: dict | None, sample_ids: list[int], verify: bool) -> bool:
    """Whether the recorded shard can be reused as it is: same samples, and the file is what the record says."""
    if entry is None or entry["sample_ids"] != sample_ids or entry["file"] != shard_name(entry["index"]):
        return False
    path = directory / entry["file"]
    problem = shard_problem(path, entry, verify)
    if problem is not None and path.is_file():  # a missing shard is an ordinary resume; a bad one is news
        print(f"{path}: {problem}; extracting it again", file=sys.stderr, flush=True)
    return problem is None


def extract_features(
    target: Target,
    samples: list[TokenSample],
    directory: str | Path,
    header: dict[str, Any],
    *,
    shard_tokens: int,
    batch_tokens: int,
    rank: int = 0,
    world_size: int = 1,
    verify_checksums: bool = True,
    barrier: Callable[[], None] = lambda: None,
    progress: bool = False,
) -> dict[str, Any] | None:
    """Extract this process's shards, then (process 0) merge all parts into the manifest and return it.

    `header` holds target, layers, hidden_size, dtype, template (+ anything else to check on resume).
    Every process calls this with the same samples; `barrier` synchronises them (accelerate's
    wait_for_everyone) before anything is written and before the merge.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan = plan_shards(samples, shard_tokens)
    # the format version follows from the dtype: compared after it, so that a refusal names the dtype
    header = {**header, "format_version": format_version(header["dtype"]), "plan_sha256": plan_sha256(samples, plan)}
    known = _known_entries(directory, header)
    layers = header["layers"]
    if header["dtype"] == "pca":
        if "encoding" not in header:
            raise ValueError("a pca extraction's header names its settings: data.codecs.encoding_settings")
        if rank == 0:
            _resolve_basis(target, samples, plan, directory, header, batch_tokens)
        barrier()  # the basis is on disk before any process reads it
        codec, _ = PcaCodec.load(directory / BASIS_FILE)
        path = directory / BASIS_FILE
        header["encoding"] = {**codec.params(), "basis": BASIS_FILE, "basis_sha256": file_sha256(path),
                              "basis_bytes": path.stat().st_size}  # fmt: skip
        known = _known_entries(directory, header)  # now without shards of another basis
    else:
        codec = make_codec(header["dtype"], len(layers), header["hidden_size"])
        if codec.encoded:
            header["encoding"] = codec.params()
    barrier()  # everyone has read the old parts before anyone rewrites its own

    mine = [k for k in range(len(plan)) if k % world_size == rank]
    done: list[dict] = []  # entries of finished shards, old and new
    todo: list[int] = []
    for k in mine:
        entry = known.get(k)
        if _is_complete(directory, entry, [samples[i]["id"] for i in plan[k]], verify_checksums):
            done.append(entry)
        else:
            todo.append(k)
    write_json_atomic(directory / part_name(rank), {"header": header, "shards": done})
    barrier()  # the parts now hold every finished shard: an old manifest must not look complete meanwhile
    if rank == 0:
        (directory / MANIFEST).unlink(missing_ok=True)

    stop_after = int(os.environ.get(STOP_AFTER_ENV, "0"))
    bar = tqdm(
        total=sum(len(plan[k]) for k in mine),
        initial=sum(e["num_samples"] for e in done),
        unit="sample",
        disable=not progress,
        desc=f"extract {directory}",
    )
    t0, tokens = time.perf_counter(), 0

    def on_batch(n_samples: int, n_tokens: int) -> None:
        nonlocal tokens
        tokens += n_tokens
        bar.update(n_samples)
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")

    for written, k in enumerate(todo, start=1):
        shard = [samples[i] for i in plan[k]]
        input_ids, loss_mask, hidden = extract_shard(target, shard, layers, codec, batch_tokens, on_batch)
        lengths = [len(s["input_ids"]) for s in shard]
        done.append(write_shard(directory, k, [s["id"] for s in shard], lengths, input_ids, loss_mask, hidden))
        write_json_atomic(directory / part_name(rank), {"header": header, "shards": done})
        if written == stop_after:
            barrier()  # so that no process is torn down by the launcher before it wrote its N shards
            sys.exit(3)
    bar.close()

    barrier()
    if rank != 0:
        return None
    return merge_parts(directory, header, len(plan), world_size)


def merge_parts(directory: Path, header: dict[str, Any], num_shards: int, world_size: int) -> dict[str, Any]:
    """Merge the parts of processes 0..world_size-1 into manifest.json; remove parts and stray .tmp files."""
    entries: dict[int, dict] = {}
    for rank in range(world_size):
        for entry in read_json_file(directory / part_name(rank), "part manifest")["shards"]:
            entries[entry["index"]] = entry
    missing = sorted(set(range(num_shards)) - set(entries))
    if missing:
        raise RuntimeError(f"{directory}: shards {missing[:5]} missing after extraction; re-run to resume")
    extra = {key: value for key, value in header.items() if key not in HEADER_KEYS and value is not None}
    manifest = build_manifest(header, list(entries.values()), extra)
    write_json_atomic(directory / MANIFEST, manifest)
    for path in [*directory.glob(PART_GLOB), *directory.glob("*.tmp")]:
        path.unlink()
    return manifest


def main(argv: list[str] | None = None) -> None:
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    from schema.recipe import RecipeError, load_recipe

    parser = argparse.ArgumentParser(prog="python -m data.extract", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    add_engine_options(parser, "the target in transformers, or in vLLM's engine (data/vllm_features.py)",
                       '{"tensor_parallel_size": 8}')  # fmt: skip
    args = parser.parse_args(argv)
    engine_args = engine_options(parser, args)
    inputs = ("target.path", "target.tokenizer", "data.train_files", "data.features_dir")
    recipe = load_recipe(args.recipe, args.overrides, inputs=inputs)
    if recipe.data.features_dir is None:
        raise RecipeError(f"{recipe.source}: data.features_dir: is required for extraction")
    state = Accelerator()  # not PartialState(): only Accelerator honours ACCELERATE_USE_CPU (multi-process CPU)
    keep_freed_memory(state.device)  # on a CPU: no page faults for every large temporary
    engine = None if args.engine == "hf" else {"python": args.engine_python, "engine_args": engine_args}
    # the features directory's lock, taken by the main process before anything is read or written there: a second
    # extraction into it stops on every one of its processes with one line naming it (DirectoryLocked)
    key = f"{recipe.source}: data.features_dir"
    with lock_for_all(recipe.data.features_dir, "extraction", key, state.is_main_process, gather_object):
        extract_recipe(recipe, state, engine)


def extract_recipe(recipe, state, engine: dict[str, Any] | None = None) -> None:
    """Extract `recipe`'s features on this process of `state` (an Accelerator): target, data, shards, manifest.
    `engine` ({"python", "engine_args"}) runs the target in vLLM (`data.vllm_features`) instead of transformers."""
    from schema.recipe import RecipeError

    if engine is None:
        target = load_placed_target(dataclasses.asdict(recipe.target), state)
        try:
            target.parts(recipe.data.layers)  # checks the layer indices before any heavy work
        except ValueError as exc:
            raise RecipeError(f"{recipe.source}: data.layers: {exc}") from None
        tokenizer = target.tokenizer
    else:
        from data.vllm_features import check_vllm_target

        try:
            tokenizer = check_vllm_target(recipe.target)
        except EngineError as exc:
            raise RecipeError(f"{recipe.source}: {exc}") from None
    if tokenizer is None:
        raise RecipeError(f"{recipe.source}: target.tokenizer: no tokenizer found for {recipe.target.path}")
    prepared: PreparedData = prepare_dataset(recipe.data, tokenizer)
    if engine is not None:
        from data.vllm_features import start_for_recipe

        try:
            target = start_for_recipe(recipe, state, engine, tokenizer, prepared.samples)
        except EngineError as exc:
            raise ExtractError(f"--engine vllm: {exc}") from None
    try:
        _extract(recipe, state, target, prepared, engine is not None)
    finally:
        if engine is not None:
            target.close()


def _extract(recipe, state, target, prepared: PreparedData, vllm: bool) -> None:
    data = recipe.data
    encoding = encoding_settings(data.storage_dtype, data.storage_bits, data.storage_fit_tokens, len(data.layers))
    header = {
        **feature_identity(target, recipe.data),
        "hidden_size": target.hidden_size,
        "dtype": data.storage_dtype,
        **({} if encoding is None else {"encoding": encoding}),
        "engine": "vllm" if vllm else None,  # a re-run extracts with the same engine (None: not in the manifest)
        "shard_tokens": recipe.data.shard_tokens,
        "prepare": prepared.stats(),
    }
    manifest = extract_features(
        target,
        prepared.samples,
        recipe.data.features_dir,
        header,
        shard_tokens=recipe.data.shard_tokens,
        batch_tokens=recipe.data.extract_batch_tokens,
        rank=state.process_index,
        world_size=state.num_processes,
        verify_checksums=recipe.data.verify_checksums,
        barrier=state.wait_for_everyone,
        progress=state.is_main_process,
    )
    if manifest is not None:
        recipe.save(Path(recipe.data.features_dir) / "recipe.yaml")
        print(
            f"{recipe.data.features_dir}: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens, "
            f"{len(manifest['shards'])} shards, {manifest['bytes_per_token']:.1f} bytes/token "
            f"(hidden {manifest['hidden_bytes_per_token']})"
        )


if __name__ == "__main__":
    from data.chat import ChatTemplateError, DataError
    from models.target import TargetError
    from schema.recipe import RecipeError

    try:
        main()
    except (
        RecipeError, DataError, ChatTemplateError, FeatureMismatchError, TargetError, ExtractError, DirectoryLocked,
        EngineError,
    ) as exc:  # fmt: skip
        sys.exit(f"error: {exc}")
