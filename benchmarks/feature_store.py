"""Feature storage encodings against bf16: bytes per token, reconstruction error, (re-)encoding and loader throughput.

    .venv/bin/python -m benchmarks.feature_store [--features artifacts/smollm2-run/features-eagle3] [--tokens 65536]
        [--threads 1] [--rounds 2] [--device cpu|cuda] [--bits 3.8] [--final-bits 6]

Encodings: bfloat16 (the baseline), fp8_e4m3, pca at `--bits` bits a value on every layer, and pca with the final
norm's layer (-1: EAGLE's training target too) at `--final-bits` and the others sharing the rest of the same
average (when -1 is stored beside other layers).

On stored features (`--features`, by default SmolLM2's EAGLE-3 set: 4 layers × 576, 4,613 bytes/token in bf16):
a subset of whole shards spread over the set (about `--tokens` tokens) is read once and written again in each
encoding into a temporary directory, the pca bases fitted as extraction fits them (`data.storage_fit_tokens`
tokens of samples spread evenly over the whole set). Reported per encoding:
- bytes per token: the subset's shard bytes per token plus the basis amortised over the whole set's tokens (what
  the whole set would take), and the ratio to bf16;
- relative RMS error per layer of the decoded states against the stored ones (over all tokens: on a trained
  model's middle layers the few "massive activation" tokens hold nearly all of it), the median over tokens of each
  token's own relative error, and, when the target's lm_head is
  at `--target`, how often its top-1 token on the decoded final states (layer -1) is the one on the stored states
  (1,024 tokens);
- re-encoding throughput: tokens/s of encode + shard write (sha256 included) from float states in memory; what
  encoding adds to an extraction, whose cost is the target's forward (not run here);
- loader throughput: tokens/s of one shuffled epoch of `BatchLoader` batches (8 rows, the set's max_len, no
  packing, as the SmolLM2 recipes train) delivered on `--device` as the float32 states the drafter computes from
  (bf16 batches moved there and cast; encoded ones decoded there), best of `--rounds`, page cache warm.

With `--cold-sets BF16_DIR ENCODED_DIR...` (whole stored sets of the same samples, the bf16 one first): the loader
over one epoch of each whole set, each dropped from the page cache first (`posix_fadvise`), so every byte comes
from the disk: what a set larger than the host's memory meets. One round each, since the first read warms the
cache. Files written moments before may still sit in a virtual machine's host cache, which reads like memory: use
sets written long before (hours on this project's VM); each line prints the rate it read at.

Without stored features (the directory has no manifest) it runs in seconds on a stand-in: a random 4-layer Llama
(d 256, vocab 8192), 16 samples × 512 tokens through `data.extract.extract_features` per encoding (so throughput
is the whole extraction: forward, fit, encode, write), layers [1, 2, 3, -1]. A random target's states are not a
trained model's: its figures are not SmolLM2's, and its goal lines print "not measured".

Goals (SmolLM2, issue #33): pca ≤ 0.25 × bf16 bytes/token, fp8 ≤ 0.51 ×, loader throughput ≥ bf16's. The τ goals
need trained drafters: see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from data.codecs import PcaCodec, encoding_settings, relative_rms
from data.extract import extract_features
from data.loader import BatchLoader
from data.shards import FeatureDataset, FeatureShardWriter, read_manifest

ROOT = Path(__file__).resolve().parents[1]
FEATURES = ROOT / "artifacts/smollm2-run/features-eagle3"
TARGET = ROOT / "artifacts/smollm2-135m-instruct"
HEAD_TOKENS = 1024


def encodings(layers: list[int], bits: float, final_bits: float) -> dict[str, tuple[str, list[float] | None]]:
    """label -> (storage dtype, pca bits per layer)."""
    n = len(layers)
    out = {"bfloat16": ("bfloat16", None), "fp8_e4m3": ("fp8_e4m3", None), f"pca {bits:g}": ("pca", [bits] * n)}
    if -1 in layers and n > 1:
        rest = round((bits * n - final_bits) / (n - 1), 4)
        split = [final_bits if layer == -1 else rest for layer in layers]
        out[f"pca {rest:g}/-1 at {final_bits:g}"] = ("pca", split)
    return out


def spread(items: list, k: int) -> list:
    """k items spread evenly over `items` (first and last included)."""
    if k >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / max(k - 1, 1))] for i in range(k)]


def lm_head(target: Path) -> torch.Tensor | None:
    """The target's output embedding (V, d) from its safetensors, or None."""
    path = target / "model.safetensors"
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        name = "lm_head.weight" if "lm_head.weight" in f.keys() else "model.embed_tokens.weight"
        return f.get_tensor(name).float() if name in f.keys() else None


def top1_agreement(head: torch.Tensor, decoded: torch.Tensor, stored: torch.Tensor) -> float:
    return float((decoded @ head.T).argmax(-1).eq((stored @ head.T).argmax(-1)).float().mean())


def drop_from_page_cache(directory: Path) -> None:
    """Write the directory's files out and drop them from the page cache: the next read comes from the disk."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def loader_rate(directory: Path, device: torch.device, max_len: int, rounds: int, cold: bool = False) -> float:
    """Tokens/s of one shuffled epoch of float32 batches delivered on `device`, best of `rounds`; `cold`: the set
    dropped from the page cache before each round."""
    best = 0.0
    for r in range(rounds):
        if cold:
            drop_from_page_cache(directory)
        ds = FeatureDataset(directory, verify_checksums=False)
        loader = BatchLoader(ds, batch_size=8, max_len=max_len, shuffle=True, seed=r, device=device)
        tokens, start = 0, time.perf_counter()
        for batch in loader.epoch(0):
            batch["hidden"].to(device, non_blocking=True).float()  # what the drafter casts to; encoded: already
            tokens += int(batch["attention_mask"].sum())
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def cold_sets(directories: list[Path], device: torch.device) -> dict[str, float]:
    """Loader tokens/s over one epoch of each whole set, read from the disk (see the module docstring); returns each
    encoded set's ratio to the first (bf16) set, keyed by its storage dtype."""
    first = read_manifest(directories[0])["dtype"]
    if first != "bfloat16":
        raise SystemExit(f"--cold-sets: the first set is the bf16 baseline, {directories[0]} is {first}")
    rates = {}
    for directory in directories:
        manifest = read_manifest(directory)
        rate = loader_rate(directory, device, manifest.get("max_len", 2048), rounds=1, cold=True)
        rates[directory] = (manifest["dtype"], rate)
        print(
            f"cold {directory}: {manifest['dtype']}, {manifest['num_tokens']:,} tokens at "
            f"{manifest['bytes_per_token']:.0f} B/token; loader {rate:,.0f} tok/s, reading "
            f"{rate * manifest['bytes_per_token'] / 1e6:.0f} MB/s "
            f"({rate / rates[directories[0]][1]:.2f} x the first set)"
        )
    base = rates[directories[0]][1]
    return {dtype: rate / base for dtype, rate in list(rates.values())[1:]}


def stored_features(args, device: torch.device) -> dict[str, dict]:
    """Re-encode a spread subset of stored features (see the module docstring); results per encoding label."""
    source = FeatureDataset(args.features, verify_checksums=False)
    manifest = source.manifest
    layers, d, full_tokens = manifest["layers"], manifest["hidden_size"], manifest["num_tokens"]
    per_shard = max(e["num_tokens"] for e in source.shards)
    shards = spread(list(range(len(source.shards))), max(1, round(args.tokens / per_shard)))
    positions = [i for i, (s, _) in enumerate(source._where) if s in set(shards)]
    samples = [source[i] for i in positions]  # the stored states, read once
    tokens = sum(len(s["input_ids"]) for s in samples)
    # fit samples as extraction picks them: every k-th sample of the (length-sorted) set
    every = max(1, full_tokens // args.fit_tokens)
    fit = torch.cat([source[i]["hidden"].float() for i in range(0, len(source), every)])
    head = lm_head(Path(args.target)) if -1 in layers else None
    print(
        f"{args.features}: {manifest['num_tokens']:,} tokens in {len(source.shards)} shards, layers {layers} x {d}, "
        f"stored {manifest['dtype']} at {manifest['bytes_per_token']:.1f} bytes/token; re-encoding shards {shards} "
        f"({len(samples)} samples, {tokens:,} tokens); pca fitted on {len(fit):,} tokens (one sample in {every})"
    )
    reference = torch.cat([s["hidden"].float() for s in samples])
    results = {}
    for label, (dtype, bits) in encodings(layers, args.bits, args.final_bits).items():
        with tempfile.TemporaryDirectory() as tmp:
            header = {k: manifest[k] for k in ("target", "layers", "hidden_size", "template")} | {"dtype": dtype}
            t = time.perf_counter()
            codec = PcaCodec.fit(fit, bits, args.fit_tokens) if dtype == "pca" else None
            fit_s = time.perf_counter() - t
            t = time.perf_counter()
            writer = FeatureShardWriter(tmp, header, shard_tokens=per_shard, codec=codec)
            for s, sample in zip(positions, samples):
                writer.add(source.sample_ids[s], sample["input_ids"], sample["loss_mask"], sample["hidden"].float())
            written = writer.close()
            encode_s = time.perf_counter() - t
            basis = written.get("encoding", {}).get("basis_bytes", 0)
            shard_bytes = written["total_bytes"] - basis
            ds = FeatureDataset(tmp, verify_checksums=False)
            decoded = torch.cat([ds[i]["hidden"].float() for i in range(len(ds))])
            result = {
                "bytes_per_token": (shard_bytes + basis * tokens / full_tokens) / tokens,
                "basis_bytes": basis,
                "errors": relative_rms(decoded, reference),
                "token_errors": median_token_error(decoded, reference),
                "encode_tok_s": tokens / encode_s,
                "fit_s": fit_s,
                "loader_tok_s": loader_rate(Path(tmp), device, manifest.get("max_len", 2048), args.rounds),
            }
            if head is not None:
                last, picked = layers.index(-1), torch.arange(0, len(reference), max(1, len(reference) // HEAD_TOKENS))
                result["top1"] = top1_agreement(head, decoded[picked, last], reference[picked, last])
            results[label] = result
    return results


def stand_in(args, device: torch.device) -> dict[str, dict]:
    """Extract a random 4-layer Llama's states in each encoding (see the module docstring)."""
    from models.target import load_target

    d, vocab, seq, n_samples, layers = 256, 8192, 512, 16, [1, 2, 3, -1]
    config = {"model_type": "llama", "vocab_size": vocab, "hidden_size": d, "intermediate_size": 704,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    target = load_target(random_init=config, dtype="float32")
    target.model.to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n_samples, seq), generator=g)
    samples = [{"id": i, "input_ids": row.tolist(), "loss_mask": [1] * seq} for i, row in enumerate(ids)]
    tokens = ids.numel()
    base = {"target": target.identity(), "layers": layers, "hidden_size": d, "template": ""}
    print(
        f"stand-in: a random-init llama, 4 layers, d {d}, {n_samples} samples x {seq} tokens, layers {layers} "
        "(no stored features: not SmolLM2's figures)"
    )
    results, reference = {}, None
    for label, (dtype, bits) in encodings(layers, args.bits, args.final_bits).items():
        with tempfile.TemporaryDirectory() as tmp:
            encoding = encoding_settings(dtype, bits or 0.0, args.fit_tokens, len(layers))
            header = {**base, "dtype": dtype, **({"encoding": encoding} if encoding else {})}
            t = time.perf_counter()
            extract_features(target, samples, tmp, header, shard_tokens=4 * seq, batch_tokens=4 * seq)
            extract_s = time.perf_counter() - t
            ds = FeatureDataset(tmp, verify_checksums=False)
            decoded = torch.cat([ds[i]["hidden"].float() for i in range(len(ds))])
            reference = decoded if reference is None else reference  # bf16 first: the reference
            manifest = read_manifest(tmp)
            results[label] = {
                "bytes_per_token": manifest["bytes_per_token"],
                "basis_bytes": manifest.get("encoding", {}).get("basis_bytes", 0),
                "errors": relative_rms(decoded, reference),
                "token_errors": median_token_error(decoded, reference),
                "encode_tok_s": tokens / extract_s,
                "loader_tok_s": loader_rate(Path(tmp), device, seq, args.rounds),
            }
    return results


def median_token_error(decoded: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per layer: the median over tokens of |decoded - reference| / |reference| ((N, n, d) each)."""
    err = (decoded.float() - reference.float()).norm(dim=-1) / reference.float().norm(dim=-1).clamp_min(1e-30)
    return err.median(dim=0).values.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.feature_store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", default=str(FEATURES), help="a stored feature set (bf16 or float32)")
    parser.add_argument("--target", default=str(TARGET), help="the target directory, for its lm_head (optional)")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens of whole shards to re-encode")
    parser.add_argument("--fit-tokens", type=int, default=32768, help="data.storage_fit_tokens")
    parser.add_argument("--bits", type=float, default=3.8, help="data.storage_bits for pca")
    parser.add_argument("--final-bits", type=float, default=6.0, help="layer -1's bits in the split pca variant")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cold-sets", nargs="*", default=[], help="whole sets read from the disk, bf16 first")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # first: reading the other sets would put some of them in a virtual machine's host cache
    cold = cold_sets([Path(p) for p in args.cold_sets], device) if args.cold_sets else {}
    real = (Path(args.features) / "manifest.json").is_file()
    results = stored_features(args, device) if real else stand_in(args, device)

    base = results["bfloat16"]
    what = "re-encode" if real else "extract"
    for label, r in results.items():
        top1 = f", lm_head top-1 on layer -1 kept {r['top1']:.4f}" if "top1" in r else ""
        basis = f" (basis {r['basis_bytes'] / 1e6:.2f} MB)" if r["basis_bytes"] else ""
        share = r["bytes_per_token"] / base["bytes_per_token"]
        errors = " ".join(f"{e:.4f}" for e in r["errors"])
        per_token = " ".join(f"{e:.4f}" for e in r["token_errors"])
        print(
            f"{label:>20}: {r['bytes_per_token']:8.1f} B/token{basis} = {share:.3f} x bf16; relative RMS error per "
            f"layer {errors} (median per token {per_token}){top1}; {what} {r['encode_tok_s']:,.0f} tok/s; "
            f"loader {r['loader_tok_s']:,.0f} tok/s on {device.type} "
            f"({r['loader_tok_s'] / base['loader_tok_s']:.2f} x bf16)"
        )
    pca = results[next(label for label in results if label.startswith("pca"))]
    ratio = lambda r: f"{r['bytes_per_token'] / base['bytes_per_token']:.3f}" if real else "not measured"  # noqa: E731
    loader = lambda r: f"{r['loader_tok_s'] / base['loader_tok_s']:.2f}" if real else "not measured"  # noqa: E731
    for name, r in (("fp8", results["fp8_e4m3"]), ("pca", pca)):
        print(f"feature_store/{name}_loader_ratio: {loader(r)} (goal >= 1.0) on {device.type}, page cache warm")
        dtype = "fp8_e4m3" if name == "fp8" else "pca"
        if dtype in cold:
            print(f"feature_store/{name}_cold_loader_ratio: {cold[dtype]:.2f} (goal >= 1.0) on {device.type}, disk")
    print(f"feature_store/fp8_bytes_ratio: {ratio(results['fp8_e4m3'])} (goal <= 0.51)")
    print(f"feature_store/pca_bytes_ratio: {ratio(pca)} (goal <= 0.25)")


if __name__ == "__main__":
    main()
