"""The drafters shipped in recipes/*/drafters: their files are what PROVENANCE.json recorded, and they load strictly
onto a target of the architecture they were trained for (random weights of the recorded config: CI has no
download), with the recorded target identity."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from models.io import load_draft_vocab, load_drafter, read_config
from models.target import load_target

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.parent for p in ROOT.glob("recipes/*/drafters/*/PROVENANCE.json"))
MAX_BYTES = 40_000_000  # EAGLE-3 carries its own head: 8,000 rows x 576 in float32 are 18 MB of SmolLM2's 39 MB


def test_the_smollm2_drafters_are_shipped():
    assert {p.name for p in SHIPPED if p.parts[-3] == "smollm2"} == {"eagle2", "eagle3", "medusa1"}


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda p: f"{p.parts[-3]}/{p.name}")
def test_files_match_their_recorded_hashes(shipped):
    provenance = json.loads((shipped / "PROVENANCE.json").read_text())
    files = {p.name for p in shipped.iterdir() if p.is_file()} - {"PROVENANCE.json"}
    assert files == set(provenance["files_sha256"])
    for name, digest in provenance["files_sha256"].items():
        assert hashlib.sha256((shipped / name).read_bytes()).hexdigest() == digest, name
    assert (shipped / "model.safetensors").stat().st_size <= MAX_BYTES
    assert provenance["target"]["source"]["sha256"]  # the GGUF the target was converted from
    jobs = provenance["selfdistill"]  # one self-distillation job, or a list of them (documentation + synthesized)
    assert all(job["records"] > 0 for job in (jobs if isinstance(jobs, list) else [jobs]))
    assert provenance["training"]["steps"] > 0


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda p: f"{p.parts[-3]}/{p.name}")
def test_loads_strictly_onto_the_recorded_architecture(shipped):
    config = json.loads((shipped / "target_config.json").read_text())
    fields = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "dtype")}
    target = load_target(random_init=fields, dtype="bfloat16")
    recorded = read_config(shipped)["target"]
    assert target.identity()["config_sha256"] == recorded["config_sha256"]  # the very config it was trained for
    drafter = load_drafter(shipped, target, check_identity=False)  # every tensor by name and shape, none missing
    vocab = load_draft_vocab(shipped)
    assert vocab is not None and len(vocab) == len(set(vocab.tolist())) and int(vocab.max()) < target.config.vocab_size
    assert sum(p.numel() for p in drafter.parameters() if p.requires_grad) > 0
    assert all(torch.isfinite(p).all() for p in drafter.parameters())


PIPELINES = sorted((ROOT / "recipes").glob("*/pipeline.yaml"))
NAMED = [(method, where, pipeline) for pipeline in PIPELINES
           for method, where in (yaml.safe_load(pipeline.read_text()).get("shipped") or {}).items()]  # fmt: skip


@pytest.mark.parametrize("method,where,pipeline", NAMED, ids=lambda x: x if isinstance(x, str) else "")
def test_shipped_drafters_were_made_by_the_recipe_their_set_names(method, where, pipeline):
    """Each drafter a set's pipeline.yaml ships is that method, made by the recipe the set names for it."""
    provenance = json.loads((ROOT / where / "PROVENANCE.json").read_text())
    config = json.loads((ROOT / where / "config.json").read_text())
    recipe = yaml.safe_load(pipeline.read_text())["recipes"][method]
    assert provenance["method"] == config["method"] == method and provenance["recipe"] == recipe
    assert config["drafter"]["method"] == yaml.safe_load((ROOT / recipe).read_text())["drafter"]["method"]
