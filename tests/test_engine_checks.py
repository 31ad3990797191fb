"""What the engine checks (`benchmarks/vllm_check.py`, `benchmarks/sglang_check.py`) compute on the project's side
and share on the engines' side, checked without vLLM or SGLang: the aux layer id edit of their negative case (one
id moved by 1, an export the engines load whose draft logits our own gates then refuse), the KV-cached causal
attention standing in for the engines' kernels, and the fed-back reference step (our drafting path, its cache cut
to each prefix) against drafting every prefix from scratch. The engine-side runs are `make check-vllm` and
`make check-sglang`. P-EAGLE's reference (evaluation's proposer at the end of every prefix) against one plain
drafter forward over the prefix and its mask slots.

    .venv/bin/pytest tests/test_engine_checks.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny import perturbed

from benchmarks.consumers_check import fed_back_reference, parallel_reference
from benchmarks.engine_side import (
    AUX_IDS,
    CAPTURED,
    CachedCausalAttention,
    copy_with_edited_aux_ids,
    edit_aux_ids,
    shifted_aux_ids,
)
from export.gates import check as gate_check
from methods.eagle2.config import EagleConfig
from methods.eagle2.model import EagleDrafter
from methods.eagle3 import layouts as eagle3_layouts
from methods.eagle3.config import Eagle3Config
from methods.eagle3.model import Eagle3Drafter
from methods.peagle.config import PeagleConfig
from methods.peagle.model import PeagleDrafter
from models.io import ExportError
from models.target import load_target
from schema.recipe import load_recipe

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TINY = {  # 5 layers, as sglang_check's target: SGLang captures the outputs of layers 0..3, room for a shifted id
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
FUSED = [1, 2, 3]  # the tiny EAGLE-3 recipe's: inputs of layers 1..3
STORED = [1, 2, 3, -1]


@pytest.mark.parametrize(
    "ids,lo,hi,shifted",
    [
        ([1, 2, 3], 0, 3, [0, 2, 3]),  # vLLM on vllm_check's 4-layer target: nothing moves up, the first moves down
        ([1, 2, 3], 0, 4, [1, 2, 4]),  # vLLM on a 5-layer target
        ([0, 1, 2], 0, 3, [0, 1, 3]),  # SGLang on sglang_check's 5-layer target
        ([2, 15, 27], 0, 29, [3, 15, 27]),  # the shipped SmolLM2 EAGLE-3 drafter, in vLLM's numbering
    ],
)
def test_one_id_moves_by_one_within_what_the_engine_captures(ids, lo, hi, shifted):
    out = shifted_aux_ids(ids, lo, hi)
    assert out == shifted
    assert sum(a != b for a, b in zip(ids, out)) == 1 and max(abs(a - b) for a, b in zip(ids, out)) == 1
    assert out == sorted(set(out)) and lo <= min(out) and max(out) <= hi


def test_ids_filling_every_captured_layer_cannot_be_shifted():
    """SGLang on a 4-layer target captures outputs of layers 0..2 only: no edit keeps 3 distinct capturable ids,
    which is why sglang_check's target has 5 layers."""
    with pytest.raises(ValueError, match="none can move"):
        shifted_aux_ids([0, 1, 2], 0, 2)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_edit_s_ranges_are_what_the_export_writes(engine):
    """`engine_side.CAPTURED` (the checks run in the engines' environments and cannot import the project) holds the
    id ranges `methods.eagle3.layouts.aux_layer_ids` writes: the lowest and highest ids pass, one beyond each is
    refused."""
    L = TINY["num_hidden_layers"]
    lo, below_top = CAPTURED[engine]
    hf = {"vllm": lambda i: i, "sglang": lambda i: i + 1}[engine]  # the HF hidden-state index of an engine id
    assert eagle3_layouts.aux_layer_ids([hf(lo), hf(L - below_top)], L, engine) == [lo, L - below_top]
    for outside in (lo - 1, L - below_top + 1):
        with pytest.raises(ExportError, match="cannot be captured"):
            eagle3_layouts.aux_layer_ids([hf(outside)], L, engine)


def test_the_edit_changes_every_place_the_ids_are_written():
    config = {AUX_IDS: [1, 2, 3], "eagle_config": {AUX_IDS: [1, 2, 3], "use_aux_hidden_state": True}}
    assert edit_aux_ids(config, 5, "vllm") == ([1, 2, 3], [1, 2, 4])
    assert config[AUX_IDS] == config["eagle_config"][AUX_IDS] == [1, 2, 4]
    with pytest.raises(ValueError, match="no eagle_aux_hidden_state_layer_ids"):
        edit_aux_ids({"eagle_config": {}}, 5, "sglang")
    with pytest.raises(ValueError, match="differ"):
        edit_aux_ids({AUX_IDS: [1, 2, 3], "eagle_config": {AUX_IDS: [0, 1, 2]}}, 5, "vllm")


@pytest.fixture(scope="module")
def eagle3_parts():
    target = load_target(random_init=TINY, dtype="float32")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config(feature_layers=FUSED, draft_vocab=64), target.parts(STORED))
    drafter.set_draft_vocab(torch.randperm(TINY["vocab_size"])[:64], init_head=True)
    return load_recipe(ROOT / "recipes/tiny/eagle3.yaml"), target, perturbed(drafter)


@pytest.mark.parametrize(
    "fmt,engine,writer,before,after",
    [
        ("vllm", "vllm", eagle3_layouts.write_speculators, [1, 2, 3], [1, 2, 4]),
        ("sglang", "sglang", eagle3_layouts.write_sglang_eagle3, [0, 1, 2], [0, 1, 3]),
    ],
)
def test_the_negative_case_is_an_export_our_gate_refuses_on_its_logits(
    fmt, engine, writer, before, after, eagle3_parts, tmp_path
):
    """The export the checks' negative case builds differs from the written one in the ids alone and stays in the
    engine's range, and the project's own gate for that consumer, which captures the states the ids name, finds
    its draft logits off: the edit is one an engine loads and drafts wrong with, not a malformed file."""
    recipe, target, drafter = eagle3_parts
    (export := tmp_path / "export").mkdir()
    writer(export, recipe, target, drafter, False)
    gate_check(fmt, export, recipe, target, drafter)  # the written export passes
    edited = tmp_path / "edited"
    assert copy_with_edited_aux_ids(export, edited, TINY["num_hidden_layers"], engine) == (before, after)
    written, changed = (json.loads((d / "config.json").read_text()) for d in (export, edited))
    where = (lambda c: c) if engine == "vllm" else (lambda c: c["eagle_config"])
    assert where(written)[AUX_IDS] == before and where(changed)[AUX_IDS] == after
    where(changed)[AUX_IDS] = before
    assert changed == written  # nothing else edited
    assert sorted(p.name for p in edited.iterdir()) == sorted(p.name for p in export.iterdir())
    with pytest.raises(ExportError, match="differ by"):
        gate_check(fmt, edited, recipe, target, drafter)


def test_cached_causal_attention_is_causal_attention_over_the_prefix_and_the_new_token():
    """An extend over T tokens is causal attention; cutting the cache to a prefix of P and attending from one new
    token equals causal attention over those P + 1 tokens (the last row), as an engine's draft step computes it."""
    gen = torch.Generator().manual_seed(0)
    T, H, Hkv, hd = 9, 4, 2, 8
    q, k, v = (torch.randn(T + 1, h * hd, generator=gen) for h in (H, Hkv, Hkv))
    layer, attn = object(), CachedCausalAttention()

    def plain(q, k, v):  # (n, ·) -> causal attention over them
        n = q.shape[0]
        q, k, v = (x.view(n, h, hd).transpose(0, 1) for x, h in ((q, H), (k, Hkv), (v, Hkv)))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
        return o.transpose(0, 1).reshape(n, -1)

    full = attn(layer, q[:T], k[:T], v[:T], H, Hkv, 0.3)
    torch.testing.assert_close(full, plain(q[:T], k[:T], v[:T]))
    saved = attn.save()
    for P in (1, 4, T):
        attn.restore(saved, P)
        one = attn(layer, q[T:], k[T:], v[T:], H, Hkv, 0.3)
        rows = [*range(P), T]
        torch.testing.assert_close(one[0], plain(q[rows], k[rows], v[rows])[-1])
        assert attn.kv[layer][0].shape[1] == P + 1
    attn.restore(saved, T)
    assert attn.kv[layer][0].shape[1] == T  # the saved extend was not written to


def eagle2_drafter(target):
    torch.manual_seed(1)
    cfg = EagleConfig(fc_norm=False, post_norm=False, fc_bias=False)
    return perturbed(EagleDrafter(cfg, target.parts([-1])))


@pytest.mark.parametrize("method", ["eagle2", "eagle3"])
def test_the_fed_back_reference_is_drafting_each_prefix_from_scratch(method, eagle3_parts):
    """`fed_back_reference` runs step 0 once and cuts its cache to each prefix; drafting each prefix with a fresh
    cache, then one step fed the drafter's own state and top-1 token (a target id), gives the same tokens and
    logits."""
    _, target, drafter = eagle3_parts
    layers = FUSED if method == "eagle3" else [-1]
    drafter = drafter if method == "eagle3" else eagle2_drafter(target)
    T, n = 10, 9
    ids = torch.randint(0, TINY["vocab_size"], (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        features = target.hidden_states(ids, torch.ones_like(ids), layers=layers).flatten(2)  # (1, T, n_fused·d)
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    tokens, fed = fed_back_reference(drafter, features, next_ids, n)
    assert tokens.shape == (n,) and fed.shape[0] == n
    positions = torch.arange(T)[None]
    for t in range(n):
        cache = drafter.new_cache()
        with torch.no_grad():
            logits, hidden = drafter.step(features[:, : t + 1], next_ids[:, : t + 1], positions[:, : t + 1], cache)
            top1 = logits[0, -1].argmax()
            token = drafter.draft_ids[top1] if method == "eagle3" else top1
            step, _ = drafter.step(
                hidden[:, -1:], token.view(1, 1), positions[:, t : t + 1] + 1, cache, from_target=False
            )
        assert token == tokens[t]
        torch.testing.assert_close(fed[t], step[0, 0].float(), rtol=1e-5, atol=1e-5)
    if method == "eagle3":
        assert torch.isin(tokens, drafter.draft_ids).all()


def test_the_parallel_reference_is_one_forward_over_each_prefix_and_its_mask_slots(eagle3_parts):
    """`parallel_reference` (evaluation's `ParallelProposer`, fresh at each prefix) gives, at the end of prefix 0..t,
    the logits of one plain causal drafter forward over the real positions 0..t (features, next tokens) and the
    K-1 mask slots after them (`mask_hidden`, `mask_token_id`, positions t+1..): its last real position and slots."""
    _, target, _ = eagle3_parts
    torch.manual_seed(3)
    drafter = PeagleDrafter(PeagleConfig(feature_layers=FUSED, draft_vocab=64, mask_token_id=5), target.parts(STORED))
    drafter.set_draft_vocab(torch.randperm(TINY["vocab_size"])[:64], init_head=True)
    drafter = perturbed(drafter)
    with torch.no_grad():
        drafter.mask_hidden.add_(torch.randn_like(drafter.mask_hidden))
    T, n, K = 8, 7, drafter.cfg.parallel_tokens
    ids = torch.randint(0, TINY["vocab_size"], (1, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        features = target.hidden_states(ids, torch.ones_like(ids), layers=FUSED)  # (1, T, 3, d)
    reference = parallel_reference(drafter, features, ids, n)
    assert reference.shape == (n, K, 64)
    for t in (0, 3, n - 1):
        x = torch.cat([features[:, : t + 1].flatten(2), drafter.mask_hidden.expand(1, K - 1, -1)], dim=1)
        tok = torch.cat([ids[:, 1 : t + 2], torch.full((1, K - 1), 5)], dim=1)
        with torch.no_grad():
            logits, _ = drafter.step(x, tok, torch.arange(t + K)[None], drafter.new_cache())
        torch.testing.assert_close(reference[t], logits[0, t:].float(), rtol=1e-5, atol=1e-5)
