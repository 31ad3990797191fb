"""Another project's trainer: an EAGLE-3 drafter trained by the `speculators` package imports with `export.imports`.

    .venv/bin/python benchmarks/speculators_train.py prepare OUT [--samples 24] [--target-dtype bfloat16]
    .venv-speculators/bin/python benchmarks/speculators_train.py train OUT [--epochs 2] [-- SPECULATORS_TRAIN_FLAGS...]
    .venv/bin/python benchmarks/speculators_train.py import OUT

(.venv-speculators is built as `make check-speculators` builds it: speculators 0.9.0 pins transformers <= 5.19.)

`prepare` (project environment) builds a tiny random Llama target (8 layers, d=64, vocab 8192, the pocket
tokenizer and chat template; saved in bfloat16 like a real checkpoint) as OUT/target, samples the target's own
responses to a few pocket prompts (speculator-format rows OUT/prepared/rows.jsonl: `input_ids`, `loss_mask` 1 on
the response) and captures what vLLM's hidden-states extraction hands speculators: the inputs of layers 2, 4, 5
(speculators' default aux ids [2, L//2, L-3]) and the last layer's output before the final norm (OUT/prepared/
hidden.safetensors), plus one held-out probe sequence (OUT/prepared/probe.safetensors).

`train` (speculators' environment; imports nothing from this project) runs speculators' own pipeline: its
`prepare-data` (`speculators.cli.prepare_data`: the arrow dataset and token_freq.pt) into OUT/data, the hidden
states laid out where its file backend reads them (OUT/data/hidden_states/hs_<row>.safetensors, vLLM's role),
then its `speculators train` entry point (`speculators.train.cli.main(TrainConfig.resolve(argv))`: its Trainer,
optimizer, vocabulary mapping and checkpointer, which writes each epoch with `save_pretrained` in bfloat16). The
last epoch's checkpoint is copied to OUT/drafter; speculators' `SpeculatorModel.from_pretrained` reloads it and its
forward on the probe (3 teacher-forced TTT steps) gives the reference logits, OUT/speculators_logits.safetensors.
The patches it needs on a CPU-only machine are applied at runtime (`cpu_patches`). Flags after `--` go to
`speculators train` (e.g. `-- --norm-before-fc` for its eagle3 default, which `export.imports` refuses).

`import` (project environment) runs `python -m export.imports OUT/drafter --format speculators --target OUT/target
--out OUT/imported --dtype float32`, loads the result with `models.io.load_drafter` and unrolls it on the probe:
its draft logits (matched by target token id) must be speculators'. Ends with
`speculators_import/max_abs_logit_diff: <x> (goal <= 0.0001)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POCKET = ROOT / "recipes" / "pocket"
GOAL = 1e-4
AUX = [2, 4, 5]  # speculators' default [2, L//2, L-3] for the 8-layer target
TTT = 3  # teacher-forced steps compared
DRAFT_VOCAB = 512


def prepare(out: Path, samples: int, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(POCKET / "target")
    ids_of = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, **ids_of)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out / "target")  # default bfloat16, like the checkpoints speculators is used on
    tok.save_pretrained(out / "target")
    model = model.float().eval()  # the saved values, computed in float32
    prenorm: list[torch.Tensor] = []
    model.model.norm.register_forward_pre_hook(lambda m, args: prenorm.append(args[0]))

    @torch.no_grad()
    def sequence(prompt: str, new: int) -> tuple[torch.Tensor, int]:
        """The chat-formatted prompt (truncated) and the target's own sampled response: (ids (T,), prompt length)."""
        chat = tok.apply_chat_template([{"role": "user", "content": prompt[:200]}], add_generation_prompt=True)
        head = torch.tensor(chat["input_ids"][-48:])[None]
        full = model.generate(head, max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0)
        return full[0], head.shape[1]

    @torch.no_grad()
    def captured(ids: torch.Tensor) -> torch.Tensor:
        """(T, 4, d): the inputs of layers AUX (vLLM's aux ids) and the last layer's output before the norm."""
        prenorm.clear()
        hs = model(ids[None], output_hidden_states=True).hidden_states
        return torch.stack([*(hs[i][0] for i in AUX), prenorm[0][0]], dim=1)

    prompts = [json.loads(line)["prompt"] for line in (POCKET / "prompts" / "train.jsonl").open()][:samples]
    (out / "prepared").mkdir(parents=True, exist_ok=True)
    tensors, rows = {}, []
    torch.manual_seed(1)
    for k, prompt in enumerate(prompts):
        ids, n = sequence(prompt, 40)
        rows.append({"input_ids": ids.tolist(), "loss_mask": [0] * n + [1] * (len(ids) - n)})
        tensors[f"ids_{k}"], tensors[f"hidden_{k}"] = ids, captured(ids).to(torch.bfloat16)  # as vLLM stores them
    (out / "prepared" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_file(tensors, str(out / "prepared" / "hidden.safetensors"))
    heldout = json.loads((POCKET / "prompts" / "heldout.jsonl").open().readline())["prompt"]
    probe, _ = sequence(heldout, 16)
    aux = captured(probe)[:, :3].flatten(1)  # (T, 3d) float32, AUX order: what speculators' fc reads
    probe_file = str(out / "prepared" / "probe.safetensors")
    save_file({"ids": probe[None].contiguous(), "aux": aux[None].contiguous()}, probe_file)
    print(f"prepared {out / 'target'} and {len(rows)} rows ({sum(len(r['input_ids']) for r in rows)} tokens), "
          f"probe T={len(probe)}")  # fmt: skip


def cpu_patches() -> None:
    """speculators 0.9.0's Trainer assumes an accelerator; each patch below is the least that runs it on a CPU."""
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer
    import torch

    if torch.accelerator.is_available():
        return
    # 1. Trainer moves the model and every batch to `get_local_rank()` (the int 0, i.e. cuda:0 with no accelerator).
    trainer.get_local_rank = lambda: "cpu"

    # 2. Trainer autocasts on `current_accelerator().type`, falling back to "cuda", which torch disables on a CPU, so
    #    the bfloat16 hidden states meet float32 weights: autocast on the CPU instead (what it does on a GPU).
    class CpuTrainer(trainer.Trainer):
        def setup_trainer(self) -> None:
            self.device_type = "cpu"
            super().setup_trainer()

    cli.Trainer = CpuTrainer
    # 3. Its step timer (on for step 0 whatever --log-freq) calls torch.accelerator.synchronize(), which raises without
    #    an accelerator; on a CPU there is nothing to wait for.
    torch.accelerator.synchronize = lambda *args, **kwargs: None


def train(out: Path, epochs: int, extra: list[str]) -> None:
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    import torch
    from datasets import load_from_disk
    from safetensors.torch import load_file, save_file
    from speculators import SpeculatorModel
    from speculators.cli.prepare_data import prepare_data
    from speculators.schema.recipe import TrainConfig
    from speculators.train.cli import main as speculators_train

    cpu_patches()
    for name in ("data", "checkpoints", "drafter", "logs"):
        shutil.rmtree(out / name, ignore_errors=True)
    data, target = out / "data", str(out / "target")
    prepare_data(model=target, data=[str(out / "prepared" / "rows.jsonl")], output=str(data), seq_length=512,
                 num_preprocessing_workers=1, skip_token_freq=False)  # fmt: skip
    # vLLM's part: hs_<i>.safetensors for row i of the prepared (shuffled) dataset, found by its token ids
    prepared = load_file(str(out / "prepared" / "hidden.safetensors"))
    by_ids = {tuple(prepared[f"ids_{k}"].tolist()): prepared[f"hidden_{k}"] for k in range(len(prepared) // 2)}
    (data / "hidden_states").mkdir()
    rows = load_from_disk(str(data))
    for i in range(len(rows)):
        ids = rows[i]["input_ids"]
        hs = {"hidden_states": by_ids[tuple(ids.tolist())], "token_ids": ids}
        save_file(hs, str(data / "hidden_states" / f"hs_{i}.safetensors"))
    argv = ["--verifier-name-or-path", target, "--data-path", str(data), "--save-path", str(out / "checkpoints"),
            "--log-dir", str(out / "logs"), "--speculator-type", "eagle3", "--target-layer-ids", *map(str, AUX),
            "--draft-vocab-size", str(DRAFT_VOCAB), "--total-seq-len", "256", "--epochs", str(epochs),
            "--num-workers", "0", "--ttt-steps", str(TTT), "--lr", "3e-3", "--seed", "0",
            # no flex attention / Triton kernels on a CPU: speculators' own alternatives
            "--draft-attn-impl", "eager", "--loss-implementation", "eager",
            # export.imports refuses its eagle3 default norm_before_fc (the project's eagle3 has no such norm)
            "--no-norm-before-fc", *extra]  # fmt: skip
    speculators_train(TrainConfig.resolve(argv))
    last = max((p for p in (out / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    shutil.copytree(last, out / "drafter")

    # _attn_implementation is never saved and picks the mask builder at construction: eager, as in training
    config = SpeculatorModel.registry["eagle3"].config_class.from_pretrained(str(out / "drafter"))
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(str(out / "drafter"), config=config).float().eval()
    print(f"speculators saved {type(model).__name__} to {out / 'drafter'} (from {last}); "
          f"norm_before_fc={model.config.norm_before_fc}, norm_output={model.config.norm_output}, "
          f"norm_before_residual={model.config.norm_before_residual}")  # fmt: skip
    probe = load_file(str(out / "prepared" / "probe.safetensors"))
    ids, T = probe["ids"], probe["ids"].shape[1]
    captured: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    with torch.no_grad():
        model(
            hidden_states=probe["aux"],
            input_ids=torch.cat([ids[:, 1:], ids[:, -1:]], dim=1),  # x_{t+1} at t
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T)[None],
            ttt_steps=TTT,
        )
    K = model.lm_head.out_features
    d2t = model.d2t if model.d2t is not None else torch.zeros(K, dtype=torch.long)
    logits = {f"logits_{j}": c.float().contiguous() for j, c in enumerate(captured)}
    save_file({**probe, **logits, "target_ids": (torch.arange(K) + d2t.long()).contiguous()},
              str(out / "speculators_logits.safetensors"))  # fmt: skip
    print(f"wrote {out / 'speculators_logits.safetensors'}: {len(captured)} TTT steps, K={K}")


def check_import(out: Path) -> float:
    sys.path.insert(0, str(ROOT))  # run as a script from the repository root's environment
    import torch
    from safetensors.torch import load_file

    from export.imports import resolve_target
    from models.io import load_drafter

    shutil.rmtree(out / "imported", ignore_errors=True)
    # float32: the probe logits are compared to 1e-4; the import's default for a directory is bfloat16
    cmd = [sys.executable, "-m", "export.imports", str(out / "drafter"), "--format", "speculators",
           "--target", str(out / "target"), "--out", str(out / "imported"), "--dtype", "float32"]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(result.stdout.strip())
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or [f"exit {result.returncode}"]
        if "Traceback" in result.stderr:  # a crash, not a refusal: show where
            print("\n".join(lines[-6:-1]), file=sys.stderr)
        raise SystemExit(f"error: export.imports refused speculators' checkpoint: {lines[-1].removeprefix('error: ')}")
    target = resolve_target(str(out / "target"), "float32")
    drafter = load_drafter(out / "imported", target).float().eval()
    drafter.cfg = dataclasses.replace(drafter.cfg, ttt_steps=TTT)  # the import writes 1 step; compare TTT
    ref = load_file(str(out / "speculators_logits.safetensors"))
    ids, aux, T = ref["ids"], ref["aux"], ref["ids"].shape[1]
    d = aux.shape[-1] // len(AUX)
    hidden = torch.zeros(1, T, len(drafter.stored_layers), d)
    for k, layer in enumerate(AUX):  # speculators' aux chunk k is vLLM id AUX[k], our HF index AUX[k]
        hidden[:, :, drafter.stored_layers.index(layer)] = aux[:, :, k * d : (k + 1) * d]
    batch = {"input_ids": ids, "hidden": hidden, "position_ids": torch.arange(T)[None],
             "attention_mask": torch.ones(1, T, dtype=torch.long), "loss_mask": torch.ones(1, T)}  # fmt: skip
    with torch.no_grad():
        outputs = drafter.unroll(batch)
    ours_order, theirs_order = drafter.draft_ids.argsort(), ref["target_ids"].argsort()
    if not torch.equal(drafter.draft_ids[ours_order].cpu(), ref["target_ids"][theirs_order]):
        raise SystemExit("error: the imported draft vocabulary differs from speculators' d2t")
    worst = 0.0
    for j, h in enumerate(outputs):
        n = T - 1 - j  # positions whose step-j token exists (the rest read padding, differently on each side)
        ours = drafter.draft_logits(h)[0, :n][:, ours_order]
        theirs = ref[f"logits_{j}"][0, :n][:, theirs_order]
        diff = (ours - theirs).abs().max().item()
        same = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
        print(f"TTT step {j}: max |logit diff| {diff:.2e}, same top-1 at {same:.3f} of {n}")
        worst = max(worst, diff if math.isfinite(diff) else math.inf)  # nan logits fail
    print(f"speculators_import/max_abs_logit_diff: {worst:.2e} (goal <= {GOAL})")
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["prepare", "train", "import"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=24, help="prepare: training sequences")
    parser.add_argument("--target-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="prepare: the saved target's dtype")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=2, help="train: speculators' epochs")
    parser.add_argument("extra", nargs="*", help="train: flags for `speculators train` (after --)")
    args = parser.parse_args(argv)
    start, out = time.monotonic(), args.out.resolve()
    if args.stage == "prepare":
        prepare(out, args.samples, args.target_dtype)
    elif args.stage == "train":
        train(out, args.epochs, args.extra)
    else:
        ok = check_import(out) <= GOAL
        print(f"{args.stage}: {time.monotonic() - start:.1f} s")
        sys.exit(0 if ok else 1)
    print(f"{args.stage}: {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
