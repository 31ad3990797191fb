"""models/memory.py: parameter counts from a config equal the built models' own, and the activation estimate stays
near the training step measured on SmolLM2's shape (docs/benchmarks.md, benchmarks/long_train.py)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from methods.eagle3.config import Eagle3Config
from methods.eagle3.model import Eagle3Drafter
from models.common import TargetParts
from models.memory import eagle3_trainable, estimate, main, shape_of, target_params

SMALL = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 9, "num_attention_heads": 4}
CONFIGS = {
    "llama": {"model_type": "llama", **SMALL, "num_key_value_heads": 2, "vocab_size": 512},
    "llama-tied": {"model_type": "llama", **SMALL, "vocab_size": 512, "tie_word_embeddings": True},
    "qwen2": {"model_type": "qwen2", **SMALL, "num_key_value_heads": 2, "vocab_size": 384},
    "mistral": {"model_type": "mistral", **SMALL, "num_key_value_heads": 1, "vocab_size": 256, "head_dim": 32},
}


def build(config: dict):
    kind = config["model_type"]
    cfg = AutoConfig.for_model(kind, **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_target_and_eagle3_counts_equal_the_built_modules(name):
    model = build(CONFIGS[name])
    s = shape_of(model.config.to_dict())
    assert target_params(s) == sum(p.numel() for p in model.parameters())
    if name == "mistral":
        return  # the drafter's attention assumes hidden = heads x head_dim
    parts = TargetParts(model.config, model.model.embed_tokens, model.lm_head, [2, 4, 6, -1])
    for layers in (1, 3):
        cfg = Eagle3Config(feature_layers=[2, 4, 6], num_layers=layers, draft_vocab=100, fc_norm=True)
        with torch.device("meta"):
            drafter = Eagle3Drafter(cfg, parts)
        trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        assert eagle3_trainable(s, 100, fused=3, fc_norm=True, num_layers=layers) == trainable


def test_activations_stay_near_the_measured_smollm2_step():
    """benchmarks/long_train.py, SmolLM2's shape, draft vocabulary 16,000, 3 unrolled steps: the step added
    1.48 / 2.80 / 4.95 GB at 2k / 4k / 8k tokens (its own AdamW state included)."""
    smollm2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
               "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
               "tie_word_embeddings": True}  # fmt: skip
    s = shape_of(smollm2)
    assert target_params(s) == 134_515_008  # SmolLM2-135M
    for tokens, measured in ((2048, 1.48), (4096, 2.80), (8192, 4.95)):
        est = estimate(s, draft_vocab=16000, tokens=tokens, ttt_steps=3)
        added = est["train_activations_gb"] + est["train_state_gb"]
        assert abs(added / measured - 1) < 0.2, (tokens, added, measured)


def test_sharding_divides_the_training_state():
    s = shape_of(CONFIGS["llama"])
    whole = estimate(s, processes=8)["train_state_gb"]
    assert estimate(s, processes=8, sharding="zero3")["train_state_gb"] == pytest.approx(whole / 8)
    assert whole / 8 < estimate(s, processes=8, sharding="zero2")["train_state_gb"] < whole


def test_cli_prints_the_estimate_and_names_a_bad_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["qwen2"]))
    assert main([str(tmp_path), "--processes", "2", "--sharding", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "9 layers, hidden 64" in out and "2 process(es), fsdp" in out
    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS["qwen2"], "hidden_size": "wide"}))
    assert main([str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: {tmp_path / 'config.json'}: hidden_size: a positive integer is needed, got 'wide'"
    )
    assert main([str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err
