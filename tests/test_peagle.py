"""P-EAGLE drafter on a tiny random Llama target: each mask slot of the training forward against a naive one-slot-at-a-
time computation, the proposer's one forward against naive drafting, lossless speculative decoding (one row and
batched rows), the tiny recipe's training, resume and exports.

    .venv/bin/pytest tests/test_peagle.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import drafted_trees, make_batch, make_samples, reset_accelerate, sample_hidden
from tiny import tiny_llama as tiny_target

from data.extract import main as extract_main
from data.loader import BatchLoader
from data.shards import FeatureDataset
from eval.baselines import plain_generate
from eval.decode import DecodeSettings, speculative_generate, speculative_generate_batch
from eval.proposal import DecodeState, VocabProjection
from eval.proposers import build_proposer
from eval.static_proposers import ParallelProposer, parallel_rank_accuracy
from eval.trees import chain, medusa_tree
from export.gates import check as gate_check
from export.write import export, load_run
from methods import METHODS
from methods.peagle.config import PeagleConfig
from methods.peagle.model import PeagleDrafter
from models.common import TargetParts
from models.io import ExportError, load_drafter
from rundir.checkpoints import latest_checkpoint
from schema.recipe import load_recipe, recipe_from_dict
from train.checkpoint import DRAFTER_FILE, METRICS_FILE
from train.loop import train

torch.set_num_threads(1)
LAYERS = [0, 1, -1]  # stored hidden states: embeddings, layer 1's input, the last one
VOCAB = 256
MASK = 3


def drafter_for(model, seed: int = 0, vocab: int = 200, **kw) -> PeagleDrafter:
    """A drafter with every weight random (norms too) over a draft vocabulary of `vocab` random target tokens."""
    torch.manual_seed(seed)
    cfg = PeagleConfig(feature_layers=[0, 1, -1], draft_vocab=vocab, mask_token_id=MASK, **kw)
    drafter = PeagleDrafter(cfg, TargetParts(model.config, model.model.embed_tokens, model.lm_head, LAYERS))
    drafter.set_draft_vocab(torch.randperm(VOCAB)[:vocab], init_head=False)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name or name == "mask_hidden":
                p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval()


@pytest.fixture(scope="module")
def setup():
    model = tiny_target()
    samples = make_samples([11, 8, 13])
    padded = make_batch(model, samples, LAYERS, rows=[[0], [1], [2]], width=13)
    packed = make_batch(model, samples, LAYERS, rows=[[0, 1], [2]], width=20)
    return model, samples, padded, packed


DEEP = {"num_layers": 3, "fc_norm": True}  # as published P-EAGLE drafters: several layers, one forward for all depths
SWITCHES = [{}, {"fc_norm": True}, {"norm_before_residual": True, "parallel_tokens": 6}, DEEP]


def naive_slots(drafter: PeagleDrafter, feats: torch.Tensor, ids: torch.Tensor, t: int, slots: int) -> torch.Tensor:
    """The final-norm outputs (1 + slots, d) at real position t and its mask slots, each computed by its own full
    forward without a cache: real positions 0..t (features, next tokens), then mask slots 1..j with dense causal
    attention, the last position's output taken."""
    out = []
    n_feat, d = len(drafter.cfg.feature_layers), drafter.fc.out_features
    for j in range(slots + 1):
        x = torch.cat([feats[:, : t + 1], drafter.mask_hidden.expand(1, j, -1)], dim=1)  # (1, t+1+j, n_feat·d)
        tok = torch.cat([ids[:, 1 : t + 2], torch.full((1, j), MASK)], dim=1)
        g = drafter.fuse_features(x.view(1, t + 1 + j, n_feat, d))
        n = t + 1 + j
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
        _, normed = drafter._predict(g, tok, torch.arange(n)[None], mask, None)
        out.append(normed[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("kw", SWITCHES)
def test_each_training_step_is_its_mask_slot(setup, kw):
    """Unrolled step j at position t == mask slot j after the real prefix 0..t, computed naively one slot count at a
    time (step 0: the real position t itself)."""
    model, _, padded, _ = setup
    drafter = drafter_for(model, **kw)
    steps = drafter.unroll(padded)
    assert len(steps) == drafter.cfg.parallel_tokens
    row = 2
    feats, ids = padded["hidden"][row : row + 1].flatten(2), padded["input_ids"][row : row + 1]
    for t in (0, 4, 9):
        want = naive_slots(drafter, feats, ids, t, len(steps) - 1)
        got = torch.stack([normed[row, t] for normed in steps])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_packed_and_padded_give_the_same_loss_and_gradients_reach_mask_hidden(setup):
    model, _, padded, packed = setup
    drafter = drafter_for(model, vocab=VOCAB, fc_norm=True)
    a, b = drafter.unroll(padded), drafter.unroll(packed)
    for j in range(len(a)):  # sample 1 sits at positions 11..18 of packed row 0
        torch.testing.assert_close(b[j][0, 11 : 19 - j - 1], a[j][1, : 8 - j - 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(drafter(padded)["loss"], drafter(packed)["loss"], atol=1e-5, rtol=1e-5)
    drafter.train()
    drafter(padded)["loss"].backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert "mask_hidden" in drafter.trainable_state_dict()
    assert all(p.grad is None for p in model.parameters())


def proposer_for(drafter, depth: int | None = None, tree=None) -> ParallelProposer:
    vocab = VocabProjection.trained(drafter.lm_head, drafter.draft_ids, VOCAB)
    return ParallelProposer(drafter, tree or chain(depth or drafter.cfg.parallel_tokens), vocab)


@pytest.mark.parametrize("kw", [*SWITCHES[:2], DEEP])
def test_the_proposer_drafts_in_one_forward_what_naive_drafting_gives(setup, kw):
    """Two rows of different lengths over two rounds (the second after each accepted part of its chain): the one
    forward's per-depth logits equal the naive mask-slot computation at each row's last real position."""
    model = setup[0]
    drafter = drafter_for(model, **kw)
    K = drafter.cfg.parallel_tokens
    proposer = proposer_for(drafter)
    proposer.reset(2)
    calls = []
    step = drafter.step
    drafter.step = lambda *a, **k: calls.append(1) or step(*a, **k)

    def hidden(tokens):
        return sample_hidden(model, tokens[0], LAYERS)[None]

    gen = torch.Generator().manual_seed(9)
    rows = [torch.randint(0, VOCAB, (1, 7), generator=gen), torch.randint(0, VOCAB, (1, 12), generator=gen)]
    cached = [0, 0]
    for paths in [[0, 1], [0, 1, 2, 3]], None:
        calls.clear()
        states = [DecodeState(tokens=t, new_hidden=hidden(t[:, :-1])[:, c:]) for t, c in zip(rows, cached)]
        ids, logp = proposer.depth_topk(states)
        assert len(calls) == 1  # one drafter forward drafts every depth
        for b, tokens in enumerate(rows):
            feats = hidden(tokens[:, :-1]).flatten(2)
            t = tokens.shape[1] - 2  # the last real position: it reads the root
            want = drafter.draft_logits(naive_slots(drafter, feats, tokens, t, K - 1))  # (K, vocab)
            assert ids[b, :, 0].tolist() == drafter.draft_ids[want.argmax(-1)].tolist()
            torch.testing.assert_close(logp[b, :, 0], want.log_softmax(-1).max(-1).values, atol=2e-5, rtol=1e-5)
        if paths is None:
            break
        chains = [torch.cat([r[0, -1:], i[:, 0]]) for r, i in zip(rows, ids)]
        cached = [t.shape[1] - 1 for t in rows]
        roots = torch.tensor([[5], [9]])
        rows = [torch.cat([t, c[None, 1 : len(p)], r[None]], dim=1) for t, c, p, r in zip(rows, chains, paths, roots)]


def test_node_scores_sum_log_probabilities_down_the_path(setup):
    drafter = drafter_for(setup[0])
    tree = medusa_tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)], 4)
    proposer = proposer_for(drafter, tree=tree)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    state = DecodeState(tokens=prompt, new_hidden=sample_hidden(setup[0], prompt[0, :-1], LAYERS)[None])
    ids, logp = proposer.depth_topk([state])
    proposer.reset(1)
    (tree_out,), (scores,) = proposer.propose_scored([state])
    assert tree_out.tokens.tolist() == [int(prompt[0, -1]), *(int(ids[0, d, r]) for d, r in
                                        [(0, 0), (0, 1), (1, 0), (1, 0), (2, 0)])]  # fmt: skip
    want = [0.0, logp[0, 0, 0], logp[0, 0, 1], logp[0, 0, 0] + logp[0, 1, 0], logp[0, 0, 1] + logp[0, 1, 0]]
    want.append(want[3] + logp[0, 2, 0])
    torch.testing.assert_close(scores, torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tree,layers", [("chain", 1), ("branching", 1), ("branching", 2)])
def test_speculative_decoding_equals_plain_greedy(setup, tree, layers):
    model = setup[0]
    drafter = drafter_for(model, vocab=64, num_layers=layers)
    shape = chain(4) if tree == "chain" else medusa_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], 4)
    proposer = proposer_for(drafter, tree=shape)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    settings = DecodeSettings(max_new_tokens=24)
    tokens, drafted = drafted_trees(model, proposer, prompt, settings)
    assert tokens == plain_generate(model, prompt, settings).tokens
    assert drafted and all(set(t[1:]) <= set(drafter.draft_ids.tolist()) for t in drafted)


def test_batched_rows_draft_what_they_draft_alone_and_decode_losslessly(setup):
    """Rows of different prompt lengths decoded together draft, round by round, the trees each drafts alone (the
    rows accept different lengths, so their caches go ragged); every output equals plain greedy decoding."""
    model = setup[0]
    drafter = drafter_for(model, vocab=VOCAB)
    shape = medusa_tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)], 4)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=gen) for n in (5, 11, 8)]
    settings = DecodeSettings(max_new_tokens=20)
    alone = []
    for prompt in prompts:
        tokens, drafted = drafted_trees(model, proposer_for(drafter, tree=shape), prompt, settings)
        assert tokens == plain_generate(model, prompt, settings).tokens
        alone.append(drafted)
    proposer = proposer_for(drafter, tree=shape)
    batched: list[list[list[int]]] = [[] for _ in prompts]
    propose = proposer.propose
    live = list(range(len(prompts)))
    keep_rows = proposer.keep_rows

    def recording(states):
        trees = propose(states)
        for row, t in zip(live, trees):
            batched[row].append(t.tokens.tolist())
        return trees

    def keeping(rows):
        live[:] = [live[r] for r in rows]
        keep_rows(rows)

    proposer.propose, proposer.keep_rows = recording, keeping
    outs = speculative_generate_batch(model, proposer, [p[0] for p in prompts], settings)
    for prompt, out in zip(prompts, outs):
        assert out.tokens == plain_generate(model, prompt, settings).tokens
    assert batched == alone


def test_calibration_measures_each_depth_and_builds_the_proposer(setup):
    model, samples, _, _ = setup
    drafter = drafter_for(model, vocab=VOCAB)
    seqs = [(sample_hidden(model, ids, LAYERS), ids, mask > 0) for ids, mask in samples]
    acc = parallel_rank_accuracy(drafter, seqs, top_k=3)
    assert acc.shape == (4, 3) and float(acc.min()) >= 0 and float(acc.max()) <= 1
    ev = recipe_from_dict(recipe()).eval
    ev = type(ev)(**{**vars(ev), "tree": "calibrated", "tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 8})
    fake = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]])
    proposer, desc = build_proposer(METHODS["peagle"], drafter, ev, calibrate=lambda k: fake[:, :k])
    assert isinstance(proposer, ParallelProposer) and desc.startswith("calibrated d3 n8")
    assert desc.endswith(f"own draft vocab {VOCAB}")


def recipe(**drafter) -> dict:
    return {
        "target": {
            "random_init": {"model_type": "llama", "num_hidden_layers": 8, "vocab_size": 1000},
            "tokenizer": "y",
        },
        "data": {"train_files": ["x.jsonl"], "layers": [2, 4, 5, -1], "features_dir": "f"},
        "drafter": {"method": "peagle", "draft_vocab": 500, **drafter},
        "eval": {"tree": "chain", "tree_depth": 4},
    }


def test_recipe_checks():
    r = recipe_from_dict(recipe())
    assert r.drafter.parallel_tokens == 4 and r.drafter.ttt_steps == 4
    with pytest.raises(Exception, match="drafter.parallel_tokens: must be >= 1"):
        recipe_from_dict(recipe(parallel_tokens=0))
    with pytest.raises(Exception, match=r"eval.tree_depth: 4 exceeds the tokens one forward drafts \(3\)"):
        recipe_from_dict(recipe(parallel_tokens=3))
    with pytest.raises(Exception, match="eval.tree: mc_sim_7b_63 is 4 deep and needs drafter.parallel_tokens >= 4"):
        recipe_from_dict({**recipe(parallel_tokens=3), "eval": {"tree": "mc_sim_7b_63"}})
    with pytest.raises(Exception, match=r"drafter.mask_token_id: 1000 is not below the target's vocab_size \(1000\)"):
        recipe_from_dict(recipe(mask_token_id=1000))
    with pytest.raises(Exception, match="eval.tree: dynamic: a peagle drafter drafts"):
        recipe_from_dict({**recipe(), "eval": {"tree": "dynamic"}})
    hashed = lambda **kw: recipe_from_dict(recipe(**kw)).section_hash("drafter")  # noqa: E731
    assert hashed() == hashed(num_layers=1) != hashed(num_layers=2)  # one-layer runs of before keep their hash


# ------------------------------------------------------------------------------------------------
# The training pipeline: extract -> train -> resume -> export (native, speculators / vLLM) -> draft

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/tiny/peagle.yaml"
QUIET = ["train.eval_every=0", "train.save_every=0", "train.log_every=1", "logging.tracker=none"]


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("peagle") / "features"
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    extract_main([str(RECIPE), f"data.features_dir={out}"])
    mp.undo()
    reset_accelerate()
    return out


def tiny_recipe(features: Path, out: Path, *overrides: str):
    return load_recipe(RECIPE, [f"data.features_dir={features}", f"train.output_dir={out}", *QUIET, *overrides])


def losses(run: Path) -> list[float]:
    return [json.loads(line)["train/loss"] for line in (run / METRICS_FILE).read_text().splitlines()]


def test_stop_and_resume_reproduces_the_uninterrupted_run(features, tmp_path, at_root):
    common = ["train.max_steps=4", "train.save_every=2", "drafter.input_noise=0.05"]
    train(tiny_recipe(features, tmp_path / "a", *common))
    reset_accelerate()
    train(tiny_recipe(features, tmp_path / "b", *common), stop_after=2)
    reset_accelerate()
    train(tiny_recipe(features, tmp_path / "b", *common, "train.resume=auto"))
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    a = load_file(str(latest_checkpoint(tmp_path / "a") / DRAFTER_FILE))
    b = load_file(str(latest_checkpoint(tmp_path / "b") / DRAFTER_FILE))
    assert "mask_hidden" in a and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def run(features, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("peagle-run") / "run"
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    reset_accelerate()
    train(tiny_recipe(features, out, "train.max_steps=3", "drafter.fc_norm=true", "drafter.num_layers=2"))
    reset_accelerate()
    mp.undo()
    return out


def test_native_export_reloads_to_identical_logits_and_drafts_losslessly(run, features, tmp_path):
    out = export(run, tmp_path / "native")
    recipe, target, drafter = load_run(run)
    loaded = load_drafter(out, target)
    assert torch.equal(loaded.mask_hidden, drafter.mask_hidden) and torch.equal(loaded.d2t, drafter.d2t)
    batch = next(BatchLoader(FeatureDataset(features), [0, 1], batch_size=2, max_len=128).batches())
    with torch.no_grad():
        for x, y in zip(loaded.unroll(batch), drafter.unroll(batch)):
            assert torch.equal(loaded.draft_logits(x), drafter.draft_logits(y))
    proposer, desc = build_proposer(METHODS["peagle"], loaded, recipe.eval, calibrate=None)
    assert desc.startswith("chain d4") and "own draft vocab 128" in desc
    prompt = torch.tensor([[5, 17, 300, 42, 9, 11]])
    settings = DecodeSettings(max_new_tokens=16)
    assert speculative_generate(target.model, proposer, prompt, settings).tokens == (
        plain_generate(target.model, prompt, settings).tokens
    )


@pytest.mark.parametrize("fmt", ["speculators", "vllm"])
def test_speculators_layout_passes_vllms_peagle_reading(fmt, run, tmp_path):
    out = export(run, tmp_path / fmt, fmt=fmt)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    _, target, drafter = load_run(run)
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == 2
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["norm_before_residual"] is False
    assert config["transformer_layer_config"]["fc_norm"] is True and "norm_output" not in config
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2 and "layers.1.mlp.up_proj.weight" in tensors
    assert torch.equal(tensors["mask_hidden"], drafter.mask_hidden.detach().view(1, 1, -1))  # speculators' shape
    assert torch.equal(tensors["embed_tokens.weight"], target.embed_tokens.weight)


@pytest.mark.parametrize(
    "edit,why",
    [
        (lambda c, t: t.pop("mask_hidden"), "no mask_hidden"),
        (lambda c, t: c.pop("mask_token_id"), "no mask_token_id"),
        (lambda c, t: c.update(mask_token_id=5), "differ by"),
        (lambda c, t: c["transformer_layer_config"].pop("fc_norm"), "differ by"),
        (lambda c, t: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]), "differ by"),
        (lambda c, t: c["transformer_layer_config"].update(num_hidden_layers=1), "differ by"),
        (lambda c, t: t.pop("layers.1.self_attn.o_proj.weight"), "layers.1.self_attn.o_proj.weight missing"),
    ],
)
def test_the_gate_catches_what_vllm_would_read_wrong(edit, why, run, tmp_path):
    out = export(run, tmp_path / "spec", fmt="speculators")
    config, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    edit(config, tensors)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    recipe, target, drafter = load_run(run)
    with pytest.raises(ExportError, match=why):
        gate_check("speculators", out, recipe, target, drafter)


def test_fused_layers_out_of_order_export_their_mask_hidden_in_layer_order(features, tmp_path, at_root):
    layers = ["drafter.feature_layers=[3,1,2]", "drafter.fc_norm=true"]
    train(tiny_recipe(features, tmp_path / "run", "train.max_steps=1", "train.warmup_steps=0", *layers))
    out = export(tmp_path / "run", tmp_path / "spec", fmt="speculators")
    _, _, drafter = load_run(tmp_path / "run")
    mask = load_file(str(out / "model.safetensors"))["mask_hidden"].view(3, -1)
    assert torch.equal(mask, drafter.mask_hidden.detach().view(3, -1)[[1, 2, 0]])
