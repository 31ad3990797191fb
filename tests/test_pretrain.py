"""recipes/pocket/pretrain.py end to end on a tiny corpus: stage 1, then a stage 2 that continues from it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tiny import accelerate_launch

pytestmark = pytest.mark.slow  # every test runs the script as a subprocess

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "recipes" / "pocket" / "pretrain.py"

TINY_MODEL = {
    "vocab_size": 8192,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


def write_corpus(root: Path) -> Path:
    corpus = root / "corpus"
    corpus.mkdir()
    for split, n in (("train", 12), ("valid", 3)):
        texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 6 for i in range(n)]
        docs = [{"path": f"{split}/{i}.py", "text": text} for i, text in enumerate(texts)]
        (corpus / f"{split}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return corpus


def run_stage(tmp: Path, name: str, launch: list[str] | None = None, **fields) -> dict:
    cfg = {
        "corpus": str(tmp / "corpus"),
        "tokenizer": str(ROOT / "recipes" / "pocket" / "target"),
        "out_dir": str(tmp / name),
        "export_dir": str(tmp / f"{name}-export"),
        "model": TINY_MODEL,
        "seq_len": 16,
        "batch_size": 2,
        "max_steps": 4,
        "warmup_steps": 1,
        "eval_every": 2,
        "eval_batches": 1,
        "save_every": 2,
        "threads": 1,
        "mixed_precision": "no",
        **fields,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    command = [*(launch or [sys.executable]), str(SCRIPT), str(path)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"} if launch else None
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    return json.loads((tmp / f"{name}-export" / "training_stats.json").read_text())


def test_stage2_starts_from_stage1_weights_and_records_it(tmp_path):
    write_corpus(tmp_path)
    stage1 = run_stage(tmp_path, "stage1")
    assert stage1["step"] == 4 and stage1["tokens_seen"] == 4 * 2 * 16 and stage1["earlier_stages"] == []

    # lr 0: AdamW changes nothing, so stage 2's export is exactly stage 1's checkpoint (in bf16)
    frozen = run_stage(tmp_path, "frozen", init_from=str(tmp_path / "stage1" / "checkpoint"), lr=0.0, seed=1)
    before = load_file(tmp_path / "stage1" / "checkpoint" / "model.safetensors")
    after = load_file(tmp_path / "frozen-export" / "model.safetensors")
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key].to(torch.bfloat16), after[key]), key
    (earlier,) = frozen["earlier_stages"]
    assert earlier["step"] == 4 and earlier["tokens_seen"] == stage1["tokens_seen"]
    assert earlier["checkpoint"] == str(tmp_path / "stage1" / "checkpoint")

    # with a learning rate it trains on from there, and a third stage sees both earlier ones
    run_stage(tmp_path, "stage2", init_from=str(tmp_path / "stage1" / "checkpoint"), lr=1e-3, seed=1)
    moved = load_file(tmp_path / "stage2-export" / "model.safetensors")
    assert any(not torch.equal(after[k], moved[k]) for k in after)
    stage3 = run_stage(tmp_path, "stage3", init_from=str(tmp_path / "stage2" / "checkpoint"), max_steps=2)
    assert [s["step"] for s in stage3["earlier_stages"]] == [4, 4]
    assert stage3["step"] == 2

    # a stage whose config describes another architecture than its init_from is refused, naming the key
    wider = {**TINY_MODEL, "hidden_size": 64}
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_stage(tmp_path, "other", init_from=str(tmp_path / "stage1" / "checkpoint"), model=wider)
    assert "model.hidden_size is 64 but init_from" in failed.value.stderr


def test_two_processes_draw_their_own_batches_and_step_the_schedule_once(tmp_path):
    """Under `accelerate launch` every process draws other windows (tokens_seen counts them all), and the
    learning-rate schedule advances once per optimizer step, not once per process."""
    write_corpus(tmp_path)
    launch = accelerate_launch("--multi_gpu", "--num_processes", "2")
    stats = run_stage(tmp_path, "two", launch=launch)
    assert stats["step"] == 4 and stats["tokens_seen"] == 2 * 4 * 2 * 16
    state = json.loads((tmp_path / "two" / "checkpoint" / "state.json").read_text())
    assert state["scheduler"]["last_epoch"] == 4

    from recipes.pocket.pretrain import PretrainConfig, train_batch

    cfg = PretrainConfig(corpus="", tokenizer="", out_dir="", export_dir="", model=TINY_MODEL, seq_len=4, batch_size=3)
    stream = torch.arange(1000)
    assert not torch.equal(train_batch(stream, cfg, 7, rank=0), train_batch(stream, cfg, 7, rank=1))


def test_resume_continues_exactly_from_json_and_safetensors(tmp_path):
    """2 steps, then `--resume` to 4, equals 4 uninterrupted steps; the checkpoint holds no pickle."""
    write_corpus(tmp_path)
    run_stage(tmp_path, "whole")
    run_stage(tmp_path, "split", max_steps=2)  # warm-up 1: the first 2 steps' rates do not depend on max_steps
    checkpoint = tmp_path / "split" / "checkpoint"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "optimizer.safetensors", "state.json"
    ]  # fmt: skip
    cfg = yaml.safe_load((tmp_path / "split.yaml").read_text()) | {"max_steps": 4}
    (tmp_path / "split.yaml").write_text(yaml.safe_dump(cfg))
    subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "split.yaml"), "--resume"],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    whole, split = (load_file(str(tmp_path / n / "checkpoint" / "model.safetensors")) for n in ("whole", "split"))
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=0, atol=0, msg=name)
    assert json.loads((checkpoint / "state.json").read_text())["step"] == 4
