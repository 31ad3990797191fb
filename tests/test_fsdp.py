"""FSDP2 through accelerate, on 2 CPU processes (gloo): the shipped `recipes/accelerate/fsdp.yaml` trains the tiny
EAGLE-3 and Medusa-2 recipes, and a run stopped and resumed writes a checkpoint byte-identical to an uninterrupted
one. (Two processes matching one process, and resuming on another number of processes, are in test_train.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tiny import accelerate_launch, reset_accelerate

from data.extract import main as extract_main
from rundir.checkpoints import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["train.eval_every=0", "train.save_every=0", "train.log_every=1", "logging.tracker=none"]


def fsdp_train(recipe: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = accelerate_launch(
        "--config_file", str(ROOT / "recipes/accelerate/fsdp.yaml"), "--num_processes", "2",
        "-m", "train", str(ROOT / "recipes/tiny" / f"{recipe}.yaml"), f"train.output_dir={out}", *QUIET, *args,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def eagle3_features(tmp_path_factory) -> Path:
    features = tmp_path_factory.mktemp("fsdp") / "features"
    extract_main([str(ROOT / "recipes/tiny/eagle3.yaml"), f"data.features_dir={features}"])
    reset_accelerate()
    return features


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["eagle3", "medusa2"])
def test_fsdp_resume_is_byte_identical_to_an_uninterrupted_run(recipe, eagle3_features, tmp_path):
    # Medusa-2 from scratch (no stage-1 heads), LoRA dropout on: the per-process RNG streams must carry over too
    extra = [f"data.features_dir={eagle3_features}"] if recipe == "eagle3" else ["drafter.stage1_heads=null"]
    extra += ["train.max_steps=4", "train.batch_size=2"]
    whole = fsdp_train(recipe, tmp_path / "whole", *extra)
    assert "on 2 processes (FSDP, cpu)" in whole.stdout, whole.stdout  # sharded, not plain data parallel
    fsdp_train(recipe, tmp_path / "resumed", *extra, "--stop-after", "2")
    assert latest_checkpoint(tmp_path / "resumed").name == "step-000002"
    fsdp_train(recipe, tmp_path / "resumed", *extra, "--resume")
    one, two = latest_checkpoint(tmp_path / "whole"), latest_checkpoint(tmp_path / "resumed")
    assert one.name == two.name == "step-000004"
    files = sorted(p.name for p in one.iterdir())
    assert "drafter.safetensors" in files and "optimizer.safetensors" in files
    assert files == sorted(p.name for p in two.iterdir())
    for name in files:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
