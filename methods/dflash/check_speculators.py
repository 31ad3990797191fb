"""DFlash's speculators export read by the speculators package's own model (`DFlashDraftModel`), in its own
environment, against our drafter's logits on the same input.

    make check-speculators     # its last step; by hand:
    .venv/bin/python -m methods.dflash.check_speculators prepare runs/dflash-check
    .venv-speculators/bin/python methods/dflash/check_speculators.py consume runs/dflash-check

`prepare` (this project's environment) saves a small random Llama target, builds a DFlash drafter on it with every
weight random (norms too), writes it in the speculators layout (`--format speculators`) and records the drafter's
block logits for every anchor of a random sequence of target features. `consume` (an environment with speculators
0.9.0 and no specdraft) loads the export with `DFlashDraftModel.from_pretrained` and the target as its verifier, runs
its training forward with every position an anchor (deterministic: anchors are then every valid position, in order)
and compares its logits with ours: one line, exit 1 on a difference.
"""

from __future__ import annotations

import sys
from pathlib import Path

T = 24  # the sequence length of the check
TOLERANCE = 1e-4


def prepare(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from methods.dflash.config import DFlashConfig
    from methods.dflash.layouts import write_speculators_dflash
    from methods.dflash.model import DFlashDrafter
    from models.common import TargetParts

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=50000.0)  # fmt: skip
    target = LlamaForCausalLM(config).eval()
    target.save_pretrained(out / "target")
    layers = [1, 3, 5]
    cfg = DFlashConfig(feature_layers=layers, num_layers=2, block_size=4, mask_token_id=7)
    drafter = DFlashDrafter(cfg, TargetParts(config, target.model.embed_tokens, target.lm_head, layers)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hidden = torch.randn(1, T, len(layers), config.hidden_size)
    ids = torch.randint(0, config.vocab_size, (1, T))
    anchors = torch.arange(T - cfg.block_size)[None]  # speculators' valid anchors: all but the last block_size
    batch = {"input_ids": ids, "position_ids": torch.arange(T)[None], "hidden": hidden,
             "attention_mask": torch.ones(1, T, dtype=torch.long), "loss_mask": torch.ones(1, T)}  # fmt: skip
    with torch.no_grad():
        normed, _, _ = drafter.blocks(batch, anchors, torch.ones_like(anchors, dtype=torch.bool))
        logits = target.lm_head(normed).flatten(1, 2)  # (1, A·Bk, V)

    class Recipe:  # what the writer reads of a recipe: the verifier's path
        class target:
            path = str((out / "target").resolve())

    (out / "export").mkdir(parents=True, exist_ok=True)
    write_speculators_dflash(out / "export", Recipe, type("T", (), {"config": config, "name": "tiny"}), drafter, False)
    torch.save({"hidden": hidden.flatten(2), "ids": ids, "logits": logits}, out / "reference.pt")
    print(f"prepared {out}: a 2-layer DFlash drafter (block 4) on a 6-layer random Llama, {T} positions")


def consume(out: Path) -> None:
    import torch
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    ref = torch.load(out / "reference.pt", weights_only=True)
    cfg = DFlashSpeculatorConfig.from_pretrained(out / "export")
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = DFlashDraftModel.from_pretrained(out / "export", config=cfg).eval()
    model.load_verifier_weights()
    ones = torch.ones(1, T, dtype=torch.long)
    with torch.no_grad():
        verifier_last = torch.zeros(1, T, cfg.transformer_layer_config.hidden_size)  # only its targets read it
        _, logits, _, _, _ = model._backbone_forward(ref["hidden"], ref["ids"], ones, verifier_last, ones * 0,
                                                     max_anchors=T)  # fmt: skip
    want = ref["logits"]
    theirs = logits[:, : want.shape[1]].float()
    diff = (theirs - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    verdict = "same" if diff <= TOLERANCE * scale else "DIFFERENT"
    print(f"speculators DFlashDraftModel on our export: logits of {want.shape[1]} block slots, max |diff| "
          f"{diff:.2e} (scale {scale:.2f}): {verdict}")  # fmt: skip
    if verdict != "same":
        sys.exit(1)


if __name__ == "__main__":
    step, where = sys.argv[1], Path(sys.argv[2])
    prepare(where) if step == "prepare" else consume(where)
