"""EAGLE drafter on a tiny random Llama target: layers against HF's Llama layer, loss against a hand
computation, gradients, frozen parts, overfitting, packing invariance, the KV-cached draft step (chain
and trees) against the uncached forward, and the FC-Norm / post-norm switches.

    .venv/bin/pytest tests/test_eagle.py -q
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny import make_batch, make_samples, trainable_names
from tiny import tiny_llama as tiny_target
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from methods.eagle2.model import EagleConfig, EagleDrafter
from models.common import DraftBatch, TargetParts
from schema.recipe import RecipeError, build_dataclass, recipe_from_dict

torch.set_num_threads(1)
LAYERS = [1, -1]  # stored hidden states in the test batches: a middle layer and the last one


def drafter_for(model, seed: int = 0, **kw) -> EagleDrafter:
    """A drafter with every weight random (norm weights too, so that the norms matter in comparisons)."""
    torch.manual_seed(seed)
    drafter = EagleDrafter(
        EagleConfig(**kw), TargetParts(model.config, model.model.embed_tokens, model.lm_head, LAYERS)
    )
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight") or ".norm." in name or name.startswith("fc_norm"):
                p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval()


@pytest.fixture(scope="module")
def setup():
    model = tiny_target()
    samples = make_samples([11, 8, 13])
    padded = make_batch(model, samples, LAYERS, rows=[[0], [1], [2]], width=13)
    packed = make_batch(model, samples, LAYERS, rows=[[0, 1], [2]], width=20)
    return model, samples, padded, packed


@torch.no_grad()
def reference_f_hat(drafter: EagleDrafter, model, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """One sample (T,), its features (T, n_feat, d) -> f̂ (T, d) through HF's own LlamaDecoderLayer."""
    cfg = copy.deepcopy(model.config)
    cfg._attn_implementation = "eager"
    T = ids.shape[0]
    if drafter.fc_norm is not None:
        feats = torch.stack([norm(feats[:, i]) for i, norm in enumerate(drafter.fc_norm)], dim=1)
    g = feats[:, 0] if drafter.fuse is None else drafter.fuse(feats.flatten(1))
    next_ids = torch.cat([ids[1:], ids[-1:]])
    h = drafter.fc(torch.cat([model.model.embed_tokens(next_ids), g], -1))[None]  # (1, T, d)
    rope = LlamaRotaryEmbedding(cfg)(h, torch.arange(T)[None])
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    for i, ours in enumerate(drafter.layers):
        hf = LlamaDecoderLayer(cfg, layer_idx=i)
        missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
        assert not unexpected and missing == ([] if i else ["input_layernorm.weight"])
        if i == 0:
            hf.input_layernorm = nn.Identity()  # EAGLE-1/2 layer 0 has none
        h = hf(h, attention_mask=mask, position_embeddings=rope)
    return (h if drafter.norm is None else drafter.norm(h))[0]


def test_config_through_recipe_builder():
    def err(key, msg):
        raise RecipeError(f"{key}: {msg}")

    cfg = build_dataclass(EagleConfig, {"method": "eagle2", "feature_layers": [1, -1], "w_ce": 0}, "drafter", err)
    assert cfg.feature_layers == [1, -1] and cfg.w_ce == 0.0
    for bad in ({"num_layers": 0}, {"input_noise": -1}, {"w_feat": 0, "w_ce": 0}, {"feature_layers": [1, 1]}):
        with pytest.raises(RecipeError, match="drafter"):
            build_dataclass(EagleConfig, {"method": "eagle2", **bad}, "drafter", err)
    raw = {
        "target": {"random_init": {"model_type": "llama", "num_hidden_layers": 2}, "tokenizer": "tok"},
        "data": {"train_files": ["x.jsonl"], "layers": [1]},
        "drafter": {"method": "eagle2", "feature_layers": [1]},
    }
    with pytest.raises(RecipeError, match="data.layers"):
        recipe_from_dict(raw)  # the last hidden state (loss target) is not stored
    online = {**raw, "train": {"online": True}}  # online, the training step computes data.layers only
    with pytest.raises(RecipeError, match="data.layers"):
        recipe_from_dict(online)
    online["data"] = {"train_files": ["x.jsonl"], "layers": [-1]}
    online["drafter"] = {"method": "eagle2", "feature_layers": [1, -1]}
    with pytest.raises(RecipeError, match=r"drafter.feature_layers: layer 1 is not stored in data.layers=\[-1\]"):
        recipe_from_dict(online)


@pytest.mark.parametrize(
    "kw", [{}, {"feature_layers": [1, -1], "num_layers": 2}, {"fc_norm": False, "post_norm": False}]
)
def test_predicted_features_match_hf_llama_layers(setup, kw):
    model, samples, padded, _ = setup
    drafter = drafter_for(model, **kw)
    f_hat = drafter.predict_features(padded)  # (B, T, d)
    slots = [LAYERS.index(layer) for layer in drafter.cfg.feature_layers]
    for b, (ids, _) in enumerate(samples):
        T = ids.shape[0]
        ref = reference_f_hat(drafter, model, ids, padded["hidden"][b, :T, slots])
        # The last position has no next token (never a loss position): compare the others.
        assert torch.allclose(f_hat[b, : T - 1], ref[:-1], atol=1e-5)


def test_follows_the_target_attention_shape_and_llama3_rope():
    """head_dim != d / heads, one KV head, Llama-3 rope scaling: still HF's layer, position for position."""
    rope = dict(rope_type="llama3", rope_theta=50000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    model = tiny_target(
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        rope_parameters={**rope, "original_max_position_embeddings": 8},
    )
    samples = make_samples([13, 9])
    batch = make_batch(model, samples, LAYERS, rows=[[0, 1]], width=24)
    drafter = drafter_for(model)
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    assert drafter.layers[0].self_attn.k_proj.weight.shape == (32, 64)
    f_hat = drafter.predict_features(batch)[0]  # (T, d)
    start = 0
    for ids, _ in samples:
        T = ids.shape[0]
        ref = reference_f_hat(drafter, model, ids, batch["hidden"][0, start : start + T, [1]])
        assert torch.allclose(f_hat[start : start + T - 1], ref[:-1], atol=1e-5)
        start += T


@pytest.mark.parametrize("kw", [{}, {"feature_layers": [1, -1], "w_feat": 0.5, "w_ce": 0.3}])
def test_loss_matches_hand_computation(setup, kw):
    model, samples, padded, _ = setup
    drafter = drafter_for(model, **kw)
    out = drafter(padded)
    slots = [LAYERS.index(layer) for layer in drafter.cfg.feature_layers]
    feat_sum = ce_sum = n_loss = hits = n_valid = 0.0
    for b, (ids, mask) in enumerate(samples):
        T = ids.shape[0]
        f = padded["hidden"][b, :T, LAYERS.index(-1)]  # (T, d) the target's last hidden state
        f_hat = reference_f_hat(drafter, model, ids, padded["hidden"][b, :T, slots])
        n_loss += mask.sum().item()
        for t in range(T - 1):
            if mask[t + 1] == 0:
                continue
            feat_sum += F.smooth_l1_loss(f_hat[t], f[t + 1]).item()  # mean over d
            p = model.lm_head(f[t + 1]).softmax(-1)
            draft = model.lm_head(f_hat[t])
            ce_sum += -(p * draft.log_softmax(-1)).sum().item()
            hits += float(draft.argmax() == p.argmax())
            n_valid += 1
    cfg = drafter.cfg
    assert out["loss_feat"].item() == pytest.approx(feat_sum / n_loss, rel=1e-4)
    assert out["loss_ce"].item() == pytest.approx(ce_sum / n_loss, rel=1e-4)
    assert out["loss"].item() == pytest.approx((cfg.w_feat * feat_sum + cfg.w_ce * ce_sum) / n_loss, rel=1e-4)
    assert out["acc@1"].item() == pytest.approx(hits / n_valid)
    assert out["acc@1"].item() <= out["acc@5"].item() <= 1.0


@pytest.mark.parametrize("kw", [{}, {"feature_layers": [1, -1]}])
def test_padded_and_packed_give_the_same_loss(setup, kw):
    model, _, padded, packed = setup
    drafter = drafter_for(model, **kw)
    a, b = drafter(padded), drafter(packed)
    for key in a:
        assert a[key].item() == pytest.approx(b[key].item(), rel=1e-5, abs=1e-7), key


def test_gradients_and_frozen_target(setup):
    model, _, padded, _ = setup
    drafter = drafter_for(model, feature_layers=[1, -1], num_layers=2).train()
    embed_before = model.model.embed_tokens.weight.clone()
    head_before = model.lm_head.weight.clone()
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)  # all parameters: frozen ones must still not move
    drafter(padded)["loss"].backward()
    params = dict(drafter.named_parameters())
    names = trainable_names(drafter)
    assert "embed_tokens.weight" not in names and "lm_head.weight" not in names
    for name in names:
        assert params[name].grad is not None and torch.count_nonzero(params[name].grad) > 0, name
    assert model.lm_head.weight.grad is None and model.model.embed_tokens.weight.grad is None
    opt.step()
    assert torch.equal(model.lm_head.weight, head_before)
    assert torch.equal(model.model.embed_tokens.weight, embed_before)
    assert set(drafter.trainable_state_dict()) == set(names)
    assert not any(drafter.is_head_param(name) for name in names)


def test_target_modules_are_borrowed_not_owned(setup):
    """embed_tokens / lm_head are the target's, by reference: out of state_dict, parameters and `.to()`."""
    model, _, padded, _ = setup
    drafter = drafter_for(model)
    assert drafter.embed_tokens is model.model.embed_tokens and drafter.lm_head is model.lm_head
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in drafter.state_dict())
    target_ptrs = {p.data_ptr() for p in model.parameters()}
    assert not target_ptrs & {p.data_ptr() for p in drafter.parameters()}
    drafter.to(torch.float64)
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    assert drafter.fc.weight.dtype == torch.float64
    assert torch.isfinite(drafter(padded)["loss"])  # float64 drafter on the float32 target's embedding and lm_head


def test_overfits_one_batch(setup):
    model, _, padded, _ = setup
    drafter = drafter_for(model).train()
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    first = drafter(padded)
    for _ in range(100):
        opt.zero_grad()
        out = drafter(padded)
        out["loss"].backward()
        opt.step()
    # The soft CE cannot go below the target distribution's entropy; the feature loss can go to ~0.
    assert out["loss_feat"].item() < 0.1 * first["loss_feat"].item()
    assert out["loss"].item() < 0.5 * first["loss"].item()
    assert out["acc@1"].item() > 0.9


def test_input_noise_only_in_training(setup):
    model, _, padded, _ = setup
    drafter = drafter_for(model, input_noise=0.5)
    clean = drafter_for(model)
    assert torch.equal(drafter(padded)["loss"], clean(padded)["loss"])  # eval mode: no noise
    drafter.train()
    assert not torch.allclose(drafter(padded)["loss"], clean(padded)["loss"])


# ------------------------------------------------------------------------------------------------
# Draft step with a KV cache


def step_inputs(batch: DraftBatch, drafter: EagleDrafter, row: int, sl: slice):
    """Target features (1, n, n_feat·d), next tokens (1, n), positions (1, n) of one batch row."""
    slots = [LAYERS.index(layer) for layer in drafter.cfg.feature_layers]
    ids = batch["input_ids"][row : row + 1]
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    feats = batch["hidden"][row : row + 1, :, slots].flatten(2)
    return feats[:, sl], next_ids[:, sl], batch["position_ids"][row : row + 1, sl]


@pytest.mark.parametrize("kw", [{}, {"feature_layers": [1, -1], "num_layers": 2}])
def test_cached_chain_matches_full_forward(setup, kw):
    model, _, padded, _ = setup
    drafter = drafter_for(model, **kw)
    full = drafter.logits(drafter.predict_features(padded))[2]  # (T, V), row 2 has no padding
    cache = drafter.new_cache()
    chunks = [slice(0, 5), slice(5, 6), slice(6, 9), slice(9, 10), slice(10, 13)]
    logits = []
    for sl in chunks:
        out, hidden = drafter.step(*step_inputs(padded, drafter, 2, sl), cache)
        assert hidden.shape == (1, sl.stop - sl.start, 64)
        logits.append(out[0])
    assert cache.length == 13
    assert torch.allclose(torch.cat(logits), full, atol=1e-5)


def test_chain_drafting_on_own_hidden_matches_one_uncached_call(setup):
    """Autoregressive drafting (hidden_out fed back, one token a step) == one call over the same inputs."""
    model, _, padded, _ = setup
    drafter = drafter_for(model)
    feats, next_ids, pos = step_inputs(padded, drafter, 2, slice(0, 6))
    cache = drafter.new_cache()
    logits, hidden = drafter.step(feats, next_ids, pos, cache)
    inputs, ids, steps = [feats], [next_ids], [logits]
    x, token, p = hidden[:, -1:], logits[:, -1:].argmax(-1), pos[:, -1:]
    for _ in range(3):
        p = p + 1
        inputs.append(x)
        ids.append(token)
        logits, x = drafter.step(x, token, p, cache, from_target=False)
        steps.append(logits)
        token = logits.argmax(-1)
    # With feature_layers [-1] a draft hidden takes the target feature's path, so one target-style call agrees.
    once, _ = drafter.step(torch.cat(inputs, 1), torch.cat(ids, 1), torch.arange(9)[None], drafter.new_cache())
    assert torch.allclose(torch.cat(steps, 1), once, atol=1e-5)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """(n, n) bool: node i sees itself and its ancestors (parents[i] = -1: child of the cached prefix)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return mask


def test_tree_step_matches_each_path_and_commit(setup):
    model, _, padded, _ = setup
    drafter = drafter_for(model, num_layers=2)
    P, d = 6, 64
    prefix = [step_inputs(padded, drafter, row, slice(0, P)) for row in (1, 2)]
    prefix = [torch.cat(parts) for parts in zip(*prefix)]  # batch of 2 prefixes
    # Tree: a(0), b(1) under the prefix; c(2), d(3) under a; e(4) under b.
    parents = [-1, -1, 0, 0, 1]
    depth = torch.tensor([1, 1, 2, 2, 2])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, d, generator=g)  # draft hiddens of the nodes' parents
    tokens = torch.randint(0, 256, (2, 5), generator=g)
    pos = (P - 1 + depth).expand(2, 5)

    # One round with a (B, n, n) mask.
    cache = drafter.new_cache()
    drafter.step(*prefix, cache)
    tree_logits, tree_hidden = drafter.step(
        x, tokens, pos, cache, tree_mask=ancestor_mask(parents).expand(2, 5, 5), from_target=False
    )
    # Two rounds (a, b then c, d, e) with the full (B, n, S+n) mask hiding the sibling branch in the cache.
    rounds = drafter.new_cache()
    drafter.step(*prefix, rounds)
    r1, _ = drafter.step(
        x[:, :2],
        tokens[:, :2],
        pos[:, :2],
        rounds,
        tree_mask=torch.eye(2, dtype=torch.bool)[None].expand(2, 2, 2),
        from_target=False,
    )
    full = torch.zeros(3, P + 5, dtype=torch.bool)
    full[:, :P] = True
    full[:, P:] = ancestor_mask(parents)[2:]
    r2, _ = drafter.step(
        x[:, 2:], tokens[:, 2:], pos[:, 2:], rounds, tree_mask=full.expand(2, 3, P + 5), from_target=False
    )
    assert torch.allclose(torch.cat([r1, r2], 1), tree_logits, atol=1e-5)

    for path in ([0, 2], [0, 3], [1, 4]):
        chain = copy.deepcopy(cache)
        chain.crop(P)
        logits, _ = drafter.step(x[:, path], tokens[:, path], pos[:, path], chain, from_target=False)
        assert torch.allclose(logits, tree_logits[:, path], atol=1e-5)

    # Commit a different path per row, then keep drafting: equals drafting after the plain path.
    keep = torch.tensor([[*range(P), P + 0, P + 2], [*range(P), P + 1, P + 4]])
    cache.select(keep)
    assert cache.length == P + 2
    nxt = torch.randn(2, 1, d, generator=g), torch.randint(0, 256, (2, 1), generator=g), torch.full((2, 1), P + 2)
    after_commit, _ = drafter.step(*nxt, cache, from_target=False)
    for row, path in ((0, [0, 2]), (1, [1, 4])):
        chain = drafter.new_cache()
        drafter.step(*(t[row : row + 1] for t in prefix), chain)
        drafter.step(
            x[row : row + 1, path], tokens[row : row + 1, path], pos[row : row + 1, path], chain, from_target=False
        )
        ref, _ = drafter.step(*(t[row : row + 1] for t in nxt), chain, from_target=False)
        assert torch.allclose(after_commit[row], ref[0], atol=1e-5)


# ------------------------------------------------------------------------------------------------
# FC-Norm and post-norm switches


def test_norm_switches_change_the_graph(setup):
    model, _, padded, _ = setup
    both = {n for n, _ in drafter_for(model, num_layers=2).named_parameters()}
    plain = {n for n, _ in drafter_for(model, num_layers=2, fc_norm=False, post_norm=False).named_parameters()}
    assert {"fc_norm.0.weight", "norm.weight", "layers.1.input_layernorm.weight"} <= both
    assert "layers.0.input_layernorm.weight" not in both  # EAGLE-1/2 layout
    assert both - plain == {"fc_norm.0.weight", "norm.weight"}

    feats, ids, pos = step_inputs(padded, drafter_for(model), 2, slice(0, 8))
    # FC-Norm: the drafter is blind to the scale of the target features.
    normed, unnormed = drafter_for(model), drafter_for(model, fc_norm=False)
    for drafter, invariant in ((normed, True), (unnormed, False)):
        a, _ = drafter.step(feats, ids, pos, drafter.new_cache())
        b, _ = drafter.step(7.0 * feats, ids, pos, drafter.new_cache())
        assert torch.allclose(a, b, atol=1e-4) == invariant

    # Post-norm: hidden_out is the RMS-normalised layer output (times norm.weight); without it, the raw output.
    for drafter in (drafter_for(model), drafter_for(model, post_norm=False)):
        raw = {}
        drafter.layers[-1].register_forward_hook(lambda mod, args, out, raw=raw: raw.setdefault("h", out))
        logits, hidden = drafter.step(feats, ids, pos, drafter.new_cache())
        if drafter.norm is None:
            assert torch.equal(hidden, raw["h"])
        else:
            unit = hidden / drafter.norm.weight
            assert torch.allclose(unit.pow(2).mean(-1), torch.ones(1, 8), atol=1e-4)
            assert not torch.allclose(hidden, raw["h"])
        assert torch.allclose(logits, model.lm_head(hidden), atol=1e-5)


def test_bf16_target_parts_with_fp32_drafter(setup):
    """Targets load in bf16 and shards store bf16 features; the drafter trains in fp32 (or under autocast)."""
    _, samples, padded, _ = setup
    model = tiny_target().to(torch.bfloat16)
    batch = dict(padded, hidden=padded["hidden"].to(torch.bfloat16))
    drafter = drafter_for(model, feature_layers=[1, -1]).train()
    assert drafter.compute_dtype == torch.float32
    out = drafter(batch)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and drafter.fc.weight.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(drafter(batch)["loss"])
    logits, hidden = drafter.eval().step(*step_inputs(batch, drafter, 0, slice(0, 4)), drafter.new_cache())
    assert logits.dtype == torch.float32 and hidden.dtype == torch.float32


def test_a_fused_eagle2_drafter_is_evaluated_at_depth_one_only():
    """A fusion of several layers is trained for the first draft step only: its later steps would read its own
    output f̂ directly, an input training never shows it, so evaluation refuses deeper trees. The last hidden state
    named by its index L is the same feature as -1, and drafts through the same path."""
    from eval.proposers import build_proposer
    from methods import METHODS
    from schema.evaluation import EvalConfig

    model = tiny_target()
    fused = drafter_for(model, feature_layers=[1, -1])
    assert not fused.drafts_on_own_features()
    assert drafter_for(model).drafts_on_own_features()
    assert drafter_for(model, feature_layers=[2]).drafts_on_own_features()  # index L of this 2-layer target
    with pytest.raises(ValueError, match=r"^eval.tree_depth: 2 with an eagle2 drafter fusing feature layers \[1, -1\]"):
        build_proposer(METHODS["eagle2"], fused, EvalConfig(tree="chain", tree_depth=2), calibrate=None)
    build_proposer(METHODS["eagle2"], fused, EvalConfig(tree="chain", tree_depth=1), calibrate=None)
    build_proposer(METHODS["eagle2"], drafter_for(model), EvalConfig(tree="chain", tree_depth=2), calibrate=None)
