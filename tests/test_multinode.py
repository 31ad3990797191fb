"""A multi-node rehearsal on one machine: the shipped `recipes/accelerate/multinode.yaml` launched as 2 machines x 1
process (machine ranks 0 and 1, the main process on the loopback address), CPU processes over gloo. Training killed
with SIGKILL on both machines and resumed ends byte-identical to an uninterrupted 2-machine run; sharded extraction
writes the features one process writes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from tiny import accelerate_launch, reset_accelerate

from data.extract import main as extract_main
from data.shards import FeatureDataset
from rundir.checkpoints import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes/tiny/eagle2.yaml")
QUIET = ["train.eval_every=0", "train.log_every=1", "logging.tracker=none"]
ENV = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"} | {
    "ACCELERATE_USE_CPU": "true",  # the config says MULTI_GPU; on CPU processes that is DDP over gloo
    "OMP_NUM_THREADS": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(*args: str) -> list[subprocess.Popen]:
    """Machine ranks 0 and 1 of the shipped multi-node config, each 1 process, rendezvous on 127.0.0.1."""
    port = str(free_port())
    nodes = []
    for rank in (1, 0):
        cmd = accelerate_launch(
            "--config_file", str(ROOT / "recipes/accelerate/multinode.yaml"), "--num_machines", "2",
            "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
            "--main_process_port", port, *args,
        )  # fmt: skip
        nodes.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return nodes


def finish(nodes: list[subprocess.Popen]) -> str:
    """Both machines' exit (each must succeed); machine rank 0's stdout."""
    outs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err[-3000:]
    return outs[1][0]


def started(run: Path) -> bool:
    """A checkpoint after step 2 is there (older ones may have been pruned)."""
    newest = latest_checkpoint(run)
    return newest is not None and newest.name >= "step-000002"


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("multinode") / "features"
    extract_main([RECIPE, f"data.features_dir={out}"])
    reset_accelerate()
    return out


@pytest.mark.slow
def test_training_killed_on_both_machines_resumes_byte_identical(features, tmp_path):
    steps = 24
    common = [f"data.features_dir={features}", *QUIET, f"train.max_steps={steps}", "train.batch_size=2"]
    whole = tmp_path / "whole"
    out = finish(start_nodes("-m", "train", RECIPE, f"train.output_dir={whole}", "train.save_every=0", *common))
    assert "on 2 processes (MULTI_CPU, cpu)" in out, out

    killed = tmp_path / "killed"
    nodes = start_nodes("-m", "train", RECIPE, f"train.output_dir={killed}", "train.save_every=1", *common)
    deadline = time.monotonic() + 240
    while not started(killed) and time.monotonic() < deadline and nodes[1].poll() is None:
        time.sleep(0.02)
    # a machine lost: SIGKILL to its launcher and everything under it (torch's launcher puts its workers in
    # sessions of their own, so the launcher's process group is not enough)
    victims = [p for node in nodes for p in (psutil.Process(node.pid), *psutil.Process(node.pid).children(True))]
    for victim in victims:
        victim.send_signal(signal.SIGKILL)
    psutil.wait_procs(victims, timeout=30)
    for node in nodes:
        node.communicate()
    interrupted = latest_checkpoint(killed)
    assert interrupted is not None and interrupted.name < f"step-{steps:06d}", "the kill came after the last step"
    finish(start_nodes("-m", "train", RECIPE, f"train.output_dir={killed}", "train.save_every=0", *common, "--resume"))

    one, two = latest_checkpoint(whole), latest_checkpoint(killed)
    assert one.name == two.name == f"step-{steps:06d}"
    files = sorted(p.name for p in one.iterdir())
    assert "drafter.safetensors" in files and files == sorted(p.name for p in two.iterdir())
    for name in files:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


@pytest.mark.slow
def test_sharded_extraction_on_two_machines_writes_what_one_process_does(features, tmp_path):
    two = tmp_path / "two-machines"
    finish(start_nodes("-m", "data.extract", RECIPE, f"data.features_dir={two}"))
    one, split = FeatureDataset(features), FeatureDataset(two, verify_checksums=True)
    assert [e["sample_ids"] for e in split.shards] == [e["sample_ids"] for e in one.shards]
    assert len({e["index"] for e in split.shards}) == len(split.shards) > 1  # both machines wrote shards
    position = {sample_id: i for i, sample_id in enumerate(one.sample_ids)}
    for i in range(len(split)):
        a, b = one[position[split.sample_ids[i]]], split[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["hidden"], b["hidden"], rtol=1e-5, atol=1e-6)
