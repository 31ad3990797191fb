"""Medusa heads on a tiny random Llama target: loss against a hand computation, gradients, frozen parts,
overfitting, packing invariance, distinct residual blocks.

    .venv/bin/pytest tests/test_medusa.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import make_batch, make_samples, sample_hidden, trainable_names
from tiny import tiny_llama as tiny_target
from transformers import LlamaForCausalLM

from methods.medusa1.model import MedusaConfig, MedusaHeads
from models.common import TargetParts
from schema.recipe import RecipeError, build_dataclass

torch.set_num_threads(1)


def target_parts(model: LlamaForCausalLM, layers: list[int]) -> TargetParts:
    return TargetParts(model.config, model.model.embed_tokens, model.lm_head, layers)


@pytest.fixture(scope="module")
def setup():
    model = tiny_target()
    samples = make_samples([11, 8, 13])
    padded = make_batch(model, samples, [-1], rows=[[0], [1], [2]], width=13)
    packed = make_batch(model, samples, [-1], rows=[[0, 1], [2]], width=20)
    return model, samples, padded, packed


def randomise_blocks(heads: MedusaHeads, seed: int = 0) -> None:
    """Nonzero W1 so the residual blocks matter in the hand computation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stack in heads.blocks:
            for layer in stack.layers:
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.1)


def test_config_through_recipe_builder():
    def err(key, msg):
        raise RecipeError(f"{key}: {msg}")

    cfg = build_dataclass(MedusaConfig, {"method": "medusa1", "num_heads": 3, "decay": 0.5}, "drafter", err)
    assert cfg.num_heads == 3 and cfg.feature_layers == [-1]
    for bad in ({"num_heads": 0}, {"num_layers": 0}, {"decay": 0.0}, {"decay": 1.5}):
        with pytest.raises(RecipeError, match="drafter"):
            build_dataclass(MedusaConfig, {"method": "medusa1", **bad}, "drafter", err)


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_loss_matches_hand_computation(setup, share_lm_head):
    model, samples, padded, _ = setup
    cfg = MedusaConfig(num_heads=3, num_layers=2, decay=0.8, share_lm_head=share_lm_head)
    heads = MedusaHeads(cfg, target_parts(model, [-1]))
    randomise_blocks(heads)
    out = heads(padded)

    total, per_head, n_loss = 0.0, [0.0] * cfg.num_heads, 0.0
    for ids, mask in samples:
        h = sample_hidden(model, ids, [-1])[:, 0]  # (T, d)
        n_loss += mask.sum().item()
        for k in range(1, cfg.num_heads + 1):
            stack = heads.blocks[k - 1].layers
            proj = model.lm_head.weight if share_lm_head else heads.lm_heads[k - 1].weight
            for t in range(ids.shape[0] - k - 1):
                if mask[t + k + 1] == 0:
                    continue
                x = h[t]
                for layer in stack:
                    x = x + F.silu(x @ layer.weight.T + layer.bias)
                ce = F.cross_entropy((x @ proj.T)[None], ids[t + k + 1][None]).item()
                total += 0.8**k * ce
                per_head[k - 1] += ce
    assert out["loss"].item() == pytest.approx(total / n_loss, rel=1e-5)
    for k in range(1, cfg.num_heads + 1):
        assert out[f"loss/head{k}"].item() == pytest.approx(per_head[k - 1] / n_loss, rel=1e-5)
        assert 0.0 <= out[f"acc@1/head{k}"].item() <= out[f"acc@5/head{k}"].item() <= 1.0


def test_padded_and_packed_give_the_same_loss(setup):
    model, _, padded, packed = setup
    heads = MedusaHeads(MedusaConfig(num_heads=3), target_parts(model, [-1]))
    randomise_blocks(heads)
    a, b = heads(padded), heads(packed)
    for key in a:
        assert a[key].item() == pytest.approx(b[key].item(), rel=1e-5, abs=1e-7), key


def test_reads_the_last_hidden_state_slot(setup):
    model, samples, padded, _ = setup
    two = make_batch(model, samples, [1, -1], rows=[[0], [1], [2]], width=13)
    heads = MedusaHeads(MedusaConfig(num_heads=2), target_parts(model, [1, -1]))
    heads_one = MedusaHeads(MedusaConfig(num_heads=2), target_parts(model, [-1]))
    heads_one.load_state_dict(heads.state_dict())
    assert heads(two)["loss"].item() == pytest.approx(heads_one(padded)["loss"].item(), rel=1e-6)


def test_blocks_have_their_own_parameters():
    model = tiny_target()
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=3), target_parts(model, [-1]))
    linears = [layer for stack in heads.blocks for layer in stack.layers]
    assert len(linears) == 9
    assert len({id(layer) for layer in linears}) == 9
    assert len({layer.weight.data_ptr() for layer in linears}) == 9
    assert len({layer.bias.data_ptr() for layer in linears}) == 9
    assert all(torch.count_nonzero(layer.weight) == 0 for layer in linears)  # W1 zero-initialised
    projs = [p.weight for p in heads.lm_heads] + [model.lm_head.weight]
    assert len({w.data_ptr() for w in projs}) == 4  # trainable copies, not views of the target's
    for w in projs[:-1]:
        assert torch.equal(w, model.lm_head.weight)
    names = set(trainable_names(heads))
    assert "blocks.1.layers.2.weight" in names and "lm_heads.2.weight" in names


def test_fresh_head_is_the_target_head(setup):
    """W1 = 0: a fresh head with b1 = 0 is exactly the target's own next-token head."""
    model, _, padded, _ = setup
    heads = MedusaHeads(MedusaConfig(num_heads=2), target_parts(model, [-1]))
    with torch.no_grad():
        for stack in heads.blocks:
            for layer in stack.layers:
                layer.bias.zero_()
    h = padded["hidden"][:, :, 0]
    logits = heads.head_logits(h)  # (K, B, T, V)
    assert logits.shape == (2, 3, 13, 256)
    assert torch.allclose(logits[1], model.lm_head(h), atol=1e-6)
    assert torch.equal(heads.head_logits(h, num_heads=1), logits[:1])  # decoding runs only the heads a tree reaches


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_gradients_and_frozen_target(setup, share_lm_head):
    model, _, padded, _ = setup
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=2, share_lm_head=share_lm_head), target_parts(model, [-1]))
    embed_before = model.model.embed_tokens.weight.clone()
    head_before = model.lm_head.weight.clone()
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)  # all parameters: frozen ones must still not move
    heads(padded)["loss"].backward()
    trainable = dict(heads.named_parameters())
    for name in trainable_names(heads):
        grad = trainable[name].grad
        assert grad is not None and torch.count_nonzero(grad) > 0, name
    assert model.lm_head.weight.grad is None and model.model.embed_tokens.weight.grad is None
    opt.step()
    assert torch.equal(model.lm_head.weight, head_before)
    assert torch.equal(model.model.embed_tokens.weight, embed_before)
    state = heads.trainable_state_dict()
    assert set(state) == set(trainable_names(heads))
    assert not any(name.startswith("lm_head.") for name in state)
    assert all(heads.is_head_param(name) for name in state)


def test_overfits_one_batch(setup):
    model, _, padded, _ = setup
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(num_heads=2), target_parts(model, [-1]))
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    first = heads(padded)["loss"].item()
    for _ in range(100):
        opt.zero_grad()
        out = heads(padded)
        out["loss"].backward()
        opt.step()
    assert out["loss"].item() < 0.1 * first
    assert out["acc@1/head1"].item() > 0.9


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_bf16_target_parts_with_fp32_heads(setup, share_lm_head):
    """Targets load in bf16 and shards store bf16 features; the heads train in fp32 (or under autocast)."""
    _, _, padded, _ = setup
    model = tiny_target().to(torch.bfloat16)
    batch = dict(padded, hidden=padded["hidden"].to(torch.bfloat16))
    heads = MedusaHeads(MedusaConfig(num_heads=2, share_lm_head=share_lm_head), target_parts(model, [-1]))
    assert heads.compute_dtype == torch.float32
    out = heads(batch)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and heads.blocks[0].layers[0].weight.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(heads(batch)["loss"])
