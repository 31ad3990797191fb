"""Medusa-2 on a tiny random Llama target: adapters off = the target, KL = 0 at initialisation, loss against a
hand computation, trainable vs frozen parameters, α schedules, stage-1 head loading, export + eval loader,
and the loop end to end (two stages; 2-process DeepSpeed ZeRO-2 = one process).

    .venv/bin/pytest tests/test_medusa2.py -q
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors.torch import load_file, save_file
from tiny import accelerate_launch, reset_accelerate
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

from data.heldout import read_heldout
from data.prepare import prepare_dataset
from methods.eagle2.model import EagleConfig, EagleDrafter
from methods.medusa1.model import MedusaConfig, MedusaHeads
from methods.medusa2.model import Medusa2Config, Medusa2Model, load_medusa2
from models.common import DraftBatch, TargetParts
from models.io import ExportError, load_draft_vocab, load_drafter, place_on_target, save_native
from models.target import Target, load_target
from rundir.checkpoints import latest_checkpoint
from schema.recipe import RecipeError, load_recipe
from schema.sections import TrainConfig
from train.checkpoint import DRAFTER_FILE, METRICS_FILE
from train.loop import TrainingError, _check_zero3_sharing
from train.optim import build_optimizer

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
V = 256


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def parts(model: LlamaForCausalLM) -> TargetParts:
    return TargetParts(model.config, model.model.embed_tokens, model.lm_head, [-1], model)


def config(**kw) -> Medusa2Config:
    return Medusa2Config(**{"num_heads": 3, "lora_r": 4, "lora_dropout": 0.0, **kw})


def randomise_adapters(model: Medusa2Model, seed: int = 3) -> None:
    """LoRA B and the heads' W1 start at zero; give them values so that every term is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or ".blocks." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_batch(rows: list[list[int]], width: int, seed: int = 1) -> DraftBatch:
    """Rows of packed samples of the given lengths, right-padded to `width`; the first third of each is prompt."""
    g = torch.Generator().manual_seed(seed)
    B = len(rows)
    batch = DraftBatch(
        input_ids=torch.zeros(B, width, dtype=torch.long),
        loss_mask=torch.zeros(B, width),
        attention_mask=torch.zeros(B, width, dtype=torch.long),
        position_ids=torch.zeros(B, width, dtype=torch.long),
    )
    for b, row in enumerate(rows):
        start = 0
        for T in row:
            sl = slice(start, start + T)
            batch["input_ids"][b, sl] = torch.randint(0, V, (T,), generator=g)
            batch["loss_mask"][b, sl] = (torch.arange(T) >= T // 3).float()
            batch["attention_mask"][b, sl] = 1
            batch["position_ids"][b, sl] = torch.arange(T)
            start += T
        batch["position_ids"][b, start:] = torch.arange(width - start) + (row[-1] if row else 0)
    return batch


def samples(batch: DraftBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids (T,), loss_mask (T,)) of every packed sample of a batch."""
    out = []
    for b in range(batch["input_ids"].shape[0]):
        real = batch["attention_mask"][b].bool()
        starts = (batch["position_ids"][b] == 0).nonzero().flatten().tolist() + [int(real.sum())]
        for s, e in zip(starts[:-1], starts[1:]):
            out.append((batch["input_ids"][b, s:e], batch["loss_mask"][b, s:e]))
    return out


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target()


# --------------------------------------------------------------------------------------------
# The module


def test_adapters_disabled_give_the_target_exactly(target):
    model = Medusa2Model(config(), parts(target)).eval()
    randomise_adapters(model)
    ids = make_batch([[12]], 12)["input_ids"]
    want = target(ids).logits
    assert type(target.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # the target itself is untouched
    with model.peft_model.disable_adapter():
        assert torch.equal(model.adapted(ids).logits, want)
    assert not torch.allclose(model.adapted(ids).logits, want, atol=1e-3)  # adapters on: another model
    # the backbone's weights are the target's tensors, not a copy
    assert model.adapted.model.embed_tokens.weight is target.model.embed_tokens.weight


def test_kl_is_zero_at_initialisation(target):
    model = Medusa2Model(config(self_distill=True, lora_dropout=0.05), parts(target))  # train mode, dropout on
    out = model(make_batch([[10, 6], [14]], 16))
    assert out["kl/base"].item() == 0.0  # LoRA B = 0: the student is the teacher exactly
    assert out["loss"].item() > 0  # the heads' losses remain


@pytest.mark.parametrize("self_distill", [False, True])
def test_loss_matches_hand_computation(target, self_distill):
    cfg = config(self_distill=self_distill, alpha_schedule="linear", alpha_warmup_steps=4, head_loss_coef=0.3)
    model = Medusa2Model(cfg, parts(target)).eval()
    randomise_adapters(model)
    model.set_step(1)
    batch = make_batch([[9, 7], [13]], 16)  # two packed samples, one padded row
    out = model(batch)

    n_loss = batch["loss_mask"].sum()
    base, heads = 0.0, 0.0
    with torch.no_grad():
        for ids, mask in samples(batch):
            T = ids.shape[0]
            h = model.adapted(ids[None], output_hidden_states=True).hidden_states[-1][0]  # (T, d) after the norm
            logits = target.lm_head(h)  # (T, V)
            for t in range(T - 1):
                if mask[t + 1]:
                    if self_distill:
                        p, q = target(ids[None]).logits[0, t].softmax(-1), logits[t].softmax(-1)
                        base += (p * (p.log() - q.log())).sum()
                    else:
                        base += F.cross_entropy(logits[t], ids[t + 1])
            for k in range(1, cfg.num_heads + 1):
                block = model.heads.blocks[k - 1].layers[0]
                head_logits = model.heads.lm_heads[k - 1](h + F.silu(block(h)))  # (T, V)
                for t in range(T - k - 1):
                    if mask[t + k + 1]:
                        heads += 0.8**k * F.cross_entropy(head_logits[t], ids[t + k + 1])
    alpha = 0.25  # linear warm-up, step 1 of 4
    want = base / n_loss + alpha * 0.3 * heads / n_loss
    torch.testing.assert_close(out["loss"], want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["kl/base" if self_distill else "loss/base"], base / n_loss, rtol=1e-4, atol=1e-6)
    assert out["alpha"].item() == alpha


def test_lora_on_a_tied_embedding_is_refused():
    """With tied embeddings the lm_head and the input embedding are one matrix: an adapter on either would, merged,
    change both, so the merged target would not be the trained one."""
    from models.common import DrafterInputError

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=V, num_key_value_heads=2, tie_word_embeddings=True, **shape))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    with pytest.raises(DrafterInputError, match=r"^drafter.lora_target_modules: \['lm_head'\] of a target with tied"):
        Medusa2Model(config(lora_target_modules=["q_proj", "lm_head"]), parts(tied.eval().requires_grad_(False)))
    Medusa2Model(config(lora_target_modules=["q_proj"]), parts(tied))
    Medusa2Model(config(lora_target_modules=["q_proj", "lm_head"]), parts(tiny_target()))  # untied: its own matrix


def test_only_lora_and_heads_train(target):
    """Two AdamW steps: LoRA A gets an exactly zero gradient at step 1 (B = 0), so 'all changed' is checked after
    step 2; frozen backbone tensors (the target's own) never change."""
    model = Medusa2Model(config(), parts(target))
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n or n.startswith("heads.") for n in trainable)
    assert sum("lora_" in n for n in trainable) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    optimizer = build_optimizer(model, TrainConfig(lr=1e-2, head_lr_mult=4.0))
    assert sorted({g["lr"] for g in optimizer.param_groups}) == [1e-2, 4e-2]
    batch = make_batch([[12, 4], [16]], 16)
    for step in range(2):
        model(batch)["loss"].backward()
        if step == 0:
            assert all(p.grad.abs().max() == 0 for n, p in model.named_parameters() if "lora_A" in n)
        optimizer.step()
        optimizer.zero_grad()
    params = dict(model.named_parameters())
    assert [n for n, v in trainable.items() if torch.equal(params[n], v)] == []
    assert [n for n, v in frozen.items() if not torch.equal(params[n], v)] == []
    assert model.trainable_state_dict().keys() == trainable.keys()
    assert {n for n in trainable if model.is_head_param(n)} == {n for n in trainable if n.startswith("heads.")}


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(target, monkeypatch):
    calls = []
    mlp_forward = LlamaMLP.forward
    monkeypatch.setattr(LlamaMLP, "forward", lambda self, x: calls.append(1) or mlp_forward(self, x))
    batch = make_batch([[10, 6], [14]], 16)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # same LoRA A initialisation
        model = Medusa2Model(config(gradient_checkpointing=checkpointing), parts(target))
        randomise_adapters(model)
        calls.clear()
        loss = model(batch)["loss"]
        loss.backward()
        assert len(calls) == 2 * (2 if checkpointing else 1)  # 2 layers, recomputed in backward
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0)
    for name, grad in grads0.items():
        torch.testing.assert_close(grads1[name], grad, msg=name)


def test_alpha_schedules():
    assert [config(alpha_schedule="constant", alpha_warmup_steps=10).alpha(s) for s in (0, 5)] == [1.0, 1.0]
    linear = config(alpha_schedule="linear", alpha_warmup_steps=10)
    assert [linear.alpha(s) for s in (0, 5, 10, 50)] == [0.0, 0.5, 1.0, 1.0]
    sine = config(alpha_schedule="sine", alpha_warmup_steps=10)
    assert sine.alpha(0) == 0.0 and sine.alpha(10) == 1.0 and sine.alpha(20) == 1.0
    assert math.isclose(sine.alpha(5), math.sin(math.pi / 4))
    assert config(alpha_schedule="sine", alpha_warmup_steps=0).alpha(0) == 1.0


# --------------------------------------------------------------------------------------------
# Stage 1 -> stage 2, export, eval


def trained_heads(target, num_layers: int = 1, share_lm_head: bool = False) -> MedusaHeads:
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=num_layers, share_lm_head=share_lm_head), parts(target))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return heads


def test_stage2_loads_stage1_heads_exactly(target, tmp_path):
    heads = trained_heads(target)
    t = Target(target, None, "tiny")
    save_native(tmp_path / "export", heads, t)
    (tmp_path / "ckpt").mkdir()
    save_file(heads.trainable_state_dict(), str(tmp_path / "ckpt" / "drafter.safetensors"))
    for where in ("export", "ckpt", "ckpt/drafter.safetensors"):
        model = Medusa2Model(config(stage1_heads=str(tmp_path / where)), parts(target))
        got = model.heads.state_dict()
        assert got.keys() == heads.state_dict().keys()
        assert all(torch.equal(got[k], v) for k, v in heads.state_dict().items())
        assert model.cfg.stage1_heads is None  # rebuilding the module from its export does not re-read them

    shared = trained_heads(target, share_lm_head=True)  # heads projecting with the frozen target lm_head
    save_native(tmp_path / "shared", shared, t)
    model = Medusa2Model(config(share_lm_head=True, stage1_heads=str(tmp_path / "shared")), parts(target))
    assert all(torch.equal(model.heads.state_dict()[k], v) for k, v in shared.state_dict().items())
    assert model.heads.lm_head is target.lm_head and not any("lm_head" in n for n in model.trainable_state_dict())
    with pytest.raises(ValueError, match=r"share_lm_head=false: missing \['lm_heads.0.weight'"):
        Medusa2Model(config(stage1_heads=str(tmp_path / "shared")), parts(target))

    save_native(tmp_path / "two-layers", trained_heads(target, num_layers=2), t)
    with pytest.raises(ValueError, match=r"stage1_heads: .*two-layers: model.safetensors does not hold Medusa-1 "):
        Medusa2Model(config(stage1_heads=str(tmp_path / "two-layers")), parts(target))
    with pytest.raises(ValueError, match=r"stage1_heads: .*nowhere: not a Medusa-1 export"):
        Medusa2Model(config(stage1_heads=str(tmp_path / "nowhere")), parts(target))


def test_export_and_eval_loader(target, tmp_path):
    t = Target(target, None, "tiny")
    model = Medusa2Model(config(), parts(target)).eval()
    randomise_adapters(model)
    save_native(tmp_path, model, t)
    model.export_extra(tmp_path, t, merge_lora=True)
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    ids = make_batch([[12]], 12)["input_ids"]
    want = model.adapted(ids).logits

    # native round trip: a new module on the same (untouched) target
    again = load_drafter(tmp_path, t)
    assert all(torch.equal(v, again.trainable_state_dict()[k]) for k, v in model.trainable_state_dict().items())
    # heads/: a Medusa-1 export
    heads = load_drafter(tmp_path / "heads", t)
    assert isinstance(heads, MedusaHeads)
    assert all(torch.equal(v, model.heads.state_dict()[k]) for k, v in heads.state_dict().items())
    # adapter/: peft's own loader on a fresh copy of the target
    peft = PeftModel.from_pretrained(tiny_target(), str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(peft(ids).logits, want, rtol=0, atol=0)
    # merged/: a plain HF model, with the RoPE base where transformers-4 serving code reads it
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert saved["rope_theta"] == saved["rope_parameters"]["rope_theta"]
    # peft and transformers write safetensors readable by their owner only: the export gives them a config's mode
    modes = {f.stat().st_mode for f in tmp_path.rglob("*") if f.suffix in (".json", ".safetensors")}
    assert len(modes) == 1 and len(list(tmp_path.rglob("*.safetensors"))) >= 3
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-5)
    # eval's entry point: LoRA attached (target untouched) or merged into the fresh target in place
    fresh = Target(tiny_target(), None, "tiny")
    attached, _ = load_medusa2(tmp_path, fresh, merge=False)
    torch.testing.assert_close(attached(ids).logits, want, rtol=0, atol=0)
    assert torch.equal(fresh.model(ids).logits, target(ids).logits)
    verifier, eval_heads = load_medusa2(tmp_path, fresh)
    assert verifier is fresh.model
    torch.testing.assert_close(fresh.model(ids).logits, want, rtol=1e-4, atol=1e-5)
    hidden = torch.randn(1, 4, 64)
    assert torch.equal(eval_heads.head_logits(hidden), model.head_logits(hidden))


def test_placing_a_drafter_moves_only_its_own_tensors():
    """A Medusa-2 drafter registers the target's layers (its LoRA backbone): placing it on the target's device must
    leave them where the target put them (a `device_map` spreads them over GPUs) and keep each adapter beside its
    layer. The meta device stands in for a `target.device` other than where the layers are."""
    target = tiny_target()
    model = Medusa2Model(config(), parts(target))
    place_on_target(model, SimpleNamespace(model=target, device=torch.device("meta")))
    assert not any(t.is_meta for t in (*target.parameters(), *target.buffers()))
    # still the target's own tensors (`.to()` moves them, onto a GPU in place; onto meta it swaps in new ones)
    assert {id(t) for t in model.peft_model.parameters()} >= {id(t) for t in target.parameters()}
    own = dict(model.named_parameters())
    assert all(p.is_meta for n, p in own.items() if n.startswith("heads."))
    lora = [p for n, p in own.items() if "lora_" in n]
    assert lora and not any(p.is_meta for p in lora)


@pytest.mark.filterwarnings("ignore:.*to a meta parameter")
def test_adapters_on_offloaded_target_layers_are_refused(tmp_path):
    """Offloaded layers (a device_map with 'cpu' / 'disk' entries beside GPUs) keep their weights on the meta
    device, and so do the adapters peft puts beside them, which no state dict can fill: refused, naming them."""
    model = Medusa2Model(config(), parts(tiny_target()))
    randomise_adapters(model)
    save_native(tmp_path, model, Target(tiny_target(), None, "tiny"))
    spread = tiny_target()
    spread.model.layers[1].to("meta")
    with pytest.raises(ExportError, match=r"model.safetensors: .*layers\.1\..*lora.* sit on target layers kept off"):
        load_drafter(tmp_path, Target(spread, None, "tiny"), check_identity=False)  # meta: no weight fingerprint
    assert all(p.is_meta for p in spread.model.layers[1].parameters())


def test_recipes_load_and_online_is_required():
    for path in ("recipes/tiny/medusa2.yaml", "recipes/pocket/medusa2.yaml", "recipes/medusa2/vicuna-7b-zero2.yaml"):
        recipe = load_recipe(ROOT / path)
        assert recipe.drafter.method == "medusa2" and recipe.train.online and recipe.train.head_lr_mult == 4
        assert recipe.drafter.feature_layers == [-1]
    with pytest.raises(RecipeError, match=r"train.online: medusa2 .* set train.online: true"):
        load_recipe(ROOT / "recipes/tiny/medusa2.yaml", ["train.online=false"])
    with pytest.raises(RecipeError, match=r"drafter.lora_r: must be >= 1"):
        load_recipe(ROOT / "recipes/tiny/medusa2.yaml", ["drafter.lora_r=0"])
    with pytest.raises(RecipeError, match=r"eval.tree_depth"):
        load_recipe(ROOT / "recipes/tiny/medusa2.yaml", ["eval.tree_depth=4"])


# --------------------------------------------------------------------------------------------
# The loop: two stages end to end, then 2-process DeepSpeed ZeRO-2 against one process

QUIET = ["train.eval_every=0", "train.save_every=0", "train.log_every=1", "logging.tracker=none"]
TINY = {"medusa1": ROOT / "recipes/tiny/medusa1.yaml", "medusa2": ROOT / "recipes/tiny/medusa2.yaml"}


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def test_two_stages_train_export_and_decode(at_root, tmp_path, capsys):
    from eval.run import run as run_eval
    from export.write import export
    from train.loop import train

    stage1 = tmp_path / "stage1"
    stage1_overrides = ["train.online=true", f"train.output_dir={stage1}", "train.max_steps=2", *QUIET]
    train(load_recipe(TINY["medusa1"], stage1_overrides))
    reset_accelerate()
    export(stage1)
    stage2 = tmp_path / "stage2"
    overrides = [f"drafter.stage1_heads={stage1 / 'export'}", f"train.output_dir={stage2}", "train.max_steps=3"]
    overrides += ["drafter.alpha_schedule=linear", "drafter.alpha_warmup_steps=2", "eval.draft_vocab=32", *QUIET]
    r = load_recipe(TINY["medusa2"], overrides)
    train(r)
    rows = metrics(stage2)
    assert [row["train/alpha"] for row in rows] == [0.0, 0.5, 1.0]  # α(step) from the loop's optimizer step
    assert all(math.isfinite(row["train/loss"]) and "train/acc@1/head3" in row for row in rows)
    reset_accelerate()
    out = export(stage2, merge_lora=True)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "heads", "adapter", "merged"}
    # no feature shards (online): the draft vocabulary is counted in the token data, without the held-out samples
    heldout = set(read_heldout(stage2))
    counts = Counter()
    for sample in prepare_dataset(r.data, load_target(**dataclasses.asdict(r.target)).tokenizer).samples:
        if sample["id"] not in heldout:
            counts.update(t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m)
    vocab = load_draft_vocab(out).tolist()
    assert len(vocab) == 32 and len(set(vocab)) == 32 and all(counts[t] > 0 for t in vocab)
    assert [counts[t] for t in vocab] == sorted((counts[t] for t in vocab), reverse=True)
    assert max(c for t, c in counts.items() if t not in vocab) <= counts[vocab[-1]]

    # `python -m eval`: the LoRA merged into the target verifies, the heads draft; greedy output = plain greedy
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n    return"}) + "\n")
    ev = [f"eval.drafter={out}", f"eval.prompts={prompts}", f"eval.output_dir={tmp_path / 'eval'}"]
    ev += ["eval.max_new_tokens=10", "eval.kernels=reference", "eval.baselines=[plain]"]
    summary = run_eval(load_recipe(TINY["medusa2"], [*overrides, *ev]))
    assert summary["lossless"] is True and summary["accept_len"] >= 1.0

    # the two-stage heads: no shards, so their factors are fitted on the LoRA-merged target's hidden states
    ev = [*ev[:2], f"eval.output_dir={tmp_path / 'eval-two-stage'}", *ev[3:], "eval.head=two_stage",
          "eval.head_rank=8", "eval.head_candidates=16", "eval.tree_top_k=4", "eval.draft_vocab=0"]  # fmt: skip
    summary = run_eval(load_recipe(TINY["medusa2"], [*overrides, *ev]))
    assert summary["lossless"] is True and "two-stage head r8 c16" in summary["tree"]
    assert "two-stage head factors computed from the target's hidden states" in capsys.readouterr().out


def test_an_online_export_whose_training_data_is_gone_names_it(at_root, tmp_path):
    """The draft vocabulary of an online run is counted in its training data at export: a file gone by then, or
    data without the run's held-out samples, is named in one line, and nothing is left that looks like an export."""
    from export.write import ExportError, export
    from train.loop import train

    data = tmp_path / "chat.jsonl"
    data.write_text((ROOT / "tests/fixtures/tiny-chat.jsonl").read_text())
    run = tmp_path / "run"
    overrides = ["train.online=true", f"train.output_dir={run}", "train.max_steps=2", "eval.draft_vocab=16", *QUIET]
    train(load_recipe(TINY["medusa1"], [f"data.train_files=[{data}]", *overrides]))
    reset_accelerate()
    records = data.read_text().splitlines()
    data.unlink()
    with pytest.raises(ExportError, match=f"eval.draft_vocab: counted in the run's training data: .*{data.name}"):
        export(run)
    assert not (run / "export").exists()
    assert 0 not in read_heldout(run)  # data rewritten with its first record only: none of the held-out ids left
    data.write_text(records[0] + "\n")
    with pytest.raises(ExportError, match="none of the run's .* held-out samples is in it: the run was trained on oth"):
        export(run)
    assert not (run / "export").exists()


@pytest.mark.slow
def test_deepspeed_zero2_two_processes_match_one(at_root, tmp_path):
    """Same global batch (1 x 4 rows vs 2 x 2 rows), dropout off: losses and trained tensors agree."""
    from train.loop import train

    common = ["drafter.stage1_heads=null", "drafter.lora_dropout=0.0", "train.max_steps=3", "train.lr=0.002", *QUIET]
    one = tmp_path / "one"
    train(load_recipe(TINY["medusa2"], [f"train.output_dir={one}", "train.batch_size=4", *common]))
    two = tmp_path / "zero2"
    cmd = [
        *accelerate_launch(),
        "--use_deepspeed", "--zero_stage", "2", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "-m", "train", str(TINY["medusa2"]), f"train.output_dir={two}", "train.batch_size=2", *common,
    ]  # fmt: skip
    # ACCELERATE_USE_CPU would silently turn the DeepSpeed launch into plain DDP
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"} | {"OMP_NUM_THREADS": "1"}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "extensions")  # DeepSpeed on CPU compiles nothing (train/loop.py)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not (tmp_path / "extensions").exists()  # no C++ build, no build lock to wait on
    losses = [[row["train/loss"] for row in metrics(out)] for out in (one, two)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    a, b = (load_file(str(latest_checkpoint(out) / DRAFTER_FILE)) for out in (one, two))
    assert a.keys() == b.keys() and any("lora_A" in k for k in a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def test_online_zero3_refused_only_when_the_drafter_shares_target_tensors():
    """EAGLE and shared-lm_head Medusa heads borrow target modules unregistered (ZeRO-3 never sees them);
    Medusa-2's LoRA backbone is made of the target's tensors and must not be partitioned under the running target."""
    model = tiny_target()
    zero3 = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    online = SimpleNamespace(train=SimpleNamespace(online=True), source="recipe.yaml")
    target = SimpleNamespace(model=model)
    _check_zero3_sharing(zero3, online, target, EagleDrafter(EagleConfig(), parts(model)))
    shared_head = MedusaHeads(MedusaConfig(num_heads=2, share_lm_head=True), parts(model))
    _check_zero3_sharing(zero3, online, target, shared_head)
    with pytest.raises(TrainingError, match="shares .* tensors with the target"):
        _check_zero3_sharing(zero3, online, target, Medusa2Model(config(), parts(model)))
