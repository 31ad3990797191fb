"""A recipe set made for a target: `python recipes/run.py DIR --new --target MODEL [--prompt-file P.jsonl]`.

Writes DIR/pipeline.yaml and DIR/eagle3.yaml (an EAGLE-3.1 drafter, the field's default), which the same command then
runs (with `--check`: checks and stops; later runs: `python recipes/run.py DIR`), from the target's config.json,
tokenizer and this machine:

- prompts: `--prompt-file` (JSONL prompt records: `messages` or `prompt`, as data.selfdistill reads them) split in
  file order, the last 10% (at least 1, at most 200) held out for evaluation, into DIR/prompts/; without it,
  ShareGPT's requests (`data.chatsets`, the packaged general set: its last 10% held out, MT-bench questions kept
  out of both);
- feature layers for any depth (`feature_layers`): low / mid / high `[2, L // 2, L - 3]` from 8 layers on, for
  shallower targets three distinct indices spread over the stack (`[0, 1, 2]` for 2 layers: 2 is the output after
  the final norm), with -1 stored for the loss;
- the draft vocabulary sized from the data: `pipeline.yaml` says `draft_vocab_coverage: 0.99`, and the driver, once
  the answers exist and before training starts, sets `drafter.draft_vocab` to the fewest most-frequent tokens that
  cover 99% of the answers' tokens (`size_draft_vocab`; the recipe file is rewritten with the number, so every
  step and any later hand run reads the same);
- sizes for the target and the machine: dtype (the config's on a GPU; float32 on a CPU without bf16 arithmetic),
  `data.max_len` (1,024 tokens on a CPU, 2,048 on a GPU, within the target's positions), `train.batch_size` the
  largest of 1-16 whose estimate (`models.memory`) takes at most half the device's memory, `train.max_steps` two
  passes over the prompts' answers (100-20,000), and one self-distillation process per GPU (2 on a CPU);
- a sweep: the drafter is also evaluated with prompt lookup in its tree and on the cost-aware tree (`sweep` in
  pipeline.yaml, always run), and the closing "What to serve" line weighs them all against prompt lookup.

Nothing in the set points at another target; each file's first line is its own command. What the steps write goes
to artifacts/DIRNAME-run/ for a set inside the repository, else to DIR/run/. An existing DIR with a pipeline.yaml is
refused (nothing is overwritten).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from recipes.steps import shown as steps_shown

ROOT = Path(__file__).resolve().parents[1]
COVERAGE = 0.99
HELDOUT_FRACTION = 0.1
MAX_HELDOUT = 200
BATCHES = (16, 8, 4, 2, 1)
SWEEP = {  # what can beat the drafter alone: prompt lookup in its tree, the cost-aware tree, both (docs/smollm2.md)
    "eagle3-lookup": ["eagle3", ["eval.lookup_tokens=10"]],
    "eagle3-cost": ["eagle3", ["eval.tree=cost", "eval.tree_depth=5", "eval.tree_total_tokens=16"]],
    "eagle3-lookup-cost": ["eagle3", ["eval.tree=cost", "eval.tree_depth=5", "eval.tree_total_tokens=16",
                                      "eval.lookup_tokens=10"]],
}  # fmt: skip


class NewSetError(ValueError):
    """Why a set cannot be made, in one line naming the file or option."""


def feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's fused low / mid / high hidden-state indices for an L-layer target: `[2, L // 2, L - 3]` from 8
    layers on; below, three distinct indices spread over 0..L (L itself is the final norm's output)."""
    L = num_layers
    if L >= 8:
        return [2, L // 2, L - 3]
    if L <= 3:
        return list(range(min(L, 2) + 1))  # 1 layer: [0, 1]; 2 or 3: [0, 1, 2]
    return [1, L // 2, L - 1]


def read_prompts(path: Path) -> list[str]:
    """The prompt file's records as JSON lines, each with its id, checked as self-distillation reads them
    (`data.selfdistill.read_prompts`: NewSetError names a bad line)."""
    from data.selfdistill import SelfDistillError
    from data.selfdistill import read_prompts as read_records

    if not path.is_file():
        raise NewSetError(f"--prompt-file {path}: no such file")
    try:
        records = read_records(path, None)
    except SelfDistillError as exc:
        raise NewSetError(str(exc)) from None
    if len(records) < 2:
        raise NewSetError(f"{path}: {len(records)} prompt record(s); a set needs at least 2 (training and held out)")
    return [json.dumps({"id": rid} | record, ensure_ascii=False) for rid, record in records]  # ids kept when split


def machine() -> dict[str, Any]:
    """GPUs, their memory (the smallest), host memory and whether the CPU does bf16 arithmetic."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus)) if gpus else 0
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return {"gpus": gpus, "gpu_memory": memory, "host_memory": host, "cpu_bf16": "avx512_bf16" in flags}


def sizes(config: dict[str, Any], prompts: int, here: dict[str, Any]) -> dict[str, Any]:
    """dtype, max_len, batch size, steps and processes for a target of `config` trained on about `prompts` answers."""
    from models.memory import MemoryError_, estimate, shape_of

    gpu = here["gpus"] > 0
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    if not gpu and dtype == "bfloat16" and not here["cpu_bf16"]:
        dtype = "float32"  # an AVX2-only CPU runs bf16 matrix products several times slower than float32
    positions = int(config.get("max_position_embeddings") or 2048)
    max_len = min(positions, 2048 if gpu else 1024)
    vocab = min(32000, int(config["vocab_size"]))
    budget = 0.5 * (here["gpu_memory"] if gpu else here["host_memory"])
    try:
        shape = shape_of(config)
        batch = next((b for b in BATCHES if estimate(shape, draft_vocab=vocab, tokens=b * max_len, ttt_steps=3)
                      ["train_total_gb"] * 1e9 <= budget), 1)  # fmt: skip
    except MemoryError_:  # a config the estimate cannot read (not a Llama-family decoder): a middle size
        batch = 4
    steps = min(20000, max(100, math.ceil(2 * prompts / batch)))
    return {"dtype": dtype, "max_len": max_len, "batch_size": batch, "max_steps": steps, "draft_vocab": vocab,
            "processes": here["gpus"] or 2}  # fmt: skip


def shown(path: Path) -> str:
    """`recipes.steps.shown` of the resolved path (relative paths are the current directory's)."""
    return steps_shown(path.resolve())


def write_set(directory: Path, target: Path, prompt_file: Path | None, here: dict[str, Any] | None = None) -> str:
    """Write the set; return a summary of what it chose."""
    if (directory / "pipeline.yaml").exists():
        raise NewSetError(f"{directory}/pipeline.yaml: exists; --new writes a set into a new directory")
    config_path = target / "config.json"
    if not config_path.is_file():
        raise NewSetError(f"--target {target}: no config.json (a Hugging Face model directory)")
    config = json.loads(config_path.read_text())
    config = config.get("text_config", config) if "num_hidden_layers" not in config else config
    layers = feature_layers(int(config["num_hidden_layers"]))
    inside = directory.resolve().is_relative_to(ROOT)
    run = Path("artifacts") / f"{directory.name}-run" if inside else directory.resolve() / "run"
    set_dir = Path(shown(directory))
    if prompt_file is not None:
        lines = read_prompts(prompt_file)
        held = min(MAX_HELDOUT, max(1, round(HELDOUT_FRACTION * len(lines))))
        train_prompts, heldout = set_dir / "prompts" / "train.jsonl", set_dir / "prompts" / "heldout.jsonl"
        chatsets = None
        count = len(lines) - held
    else:
        train_prompts, heldout = run / "sharegpt" / "train.jsonl", run / "sharegpt" / "heldout.jsonl"
        chatsets = {"source": "sharegpt", "out": str(run / "sharegpt"), "max_user_turns": 2}
        exclude = ROOT / "recipes" / "smollm2" / "prompts" / "mtbench.jsonl"  # benchmark questions stay out
        if exclude.is_file():
            chatsets["exclude"] = [shown(exclude)]
        count = 6930  # what data.chatsets keeps of the packaged ShareGPT (docs/components.md)
    here = here or machine()
    size = sizes(config, count, here)
    target_name = shown(target)
    selfdistill = {
        "prompts": str(train_prompts),
        "out": str(run / "selfdistill.jsonl"),
        "max_new_tokens": 256,
        "batch_size": 16,
        "dtype": size["dtype"],
        "processes": size["processes"],
    }
    pipeline = {
        "target": target_name,
        **({"chatsets": chatsets} if chatsets else {}),
        "selfdistill": selfdistill,
        "draft_vocab_coverage": COVERAGE,
        "recipes": {"eagle3": str(set_dir / "eagle3.yaml")},
        "sweep": SWEEP,
    }
    recipe = {
        "target": {"path": target_name, "dtype": size["dtype"]},
        "data": {
            "train_files": [selfdistill["out"]],
            "max_len": size["max_len"],
            "layers": [*layers, -1],
            "features_dir": str(run / "features-eagle3"),
            "storage_dtype": "bfloat16",
            "heldout_fraction": 0.03,
        },
        "drafter": {
            "method": "eagle3",
            "feature_layers": layers,
            "draft_vocab": size["draft_vocab"],
            "ttt_steps": 3,
            "step_decay": 0.8,
            "fc_norm": True,
            "norm_output": True,
            "input_noise": 0.05,
        },
        "train": {
            "output_dir": str(run / "eagle3"),
            "seed": 0,
            "lr": 1.0e-3,
            "betas": [0.9, 0.95],
            "warmup_steps": min(50, size["max_steps"] // 10),
            "max_steps": size["max_steps"],
            "batch_size": size["batch_size"],
            "clip_grad_norm": 0.5,
            "eval_every": max(50, size["max_steps"] // 10),
            "eval_batches": 8,
            "save_every": max(50, size["max_steps"] // 10),
            "log_every": 25,
        },
        "eval": {
            "prompts": str(heldout),
            "output_dir": str(run / "eagle3" / "eval"),
            "max_prompts": 40,
            "max_new_tokens": 128,
            "tree": "dynamic",
            "tree_depth": 4,
            "tree_top_k": 4,
            "tree_total_tokens": 12,
        },
        "logging": {"tracker": "none"},
    }
    directory.mkdir(parents=True, exist_ok=True)
    if prompt_file is not None:
        (directory / "prompts").mkdir(exist_ok=True)
        (directory / "prompts" / "train.jsonl").write_text("".join(line + "\n" for line in lines[:-held]))
        (directory / "prompts" / "heldout.jsonl").write_text("".join(line + "\n" for line in lines[-held:]))
    recipe_file = set_dir / "eagle3.yaml"
    (directory / "eagle3.yaml").write_text(
        f"# python -m data.extract {recipe_file} && python -m data.target_stats {recipe_file} && python -m train "
        f"{recipe_file} && python -m export "
        f"{recipe['train']['output_dir']} && python -m eval {recipe_file}\n"
        f"# EAGLE-3.1 drafter for {target_name}, made by `recipes/run.py --new`: fused hidden states {layers} of "
        f"{config['num_hidden_layers']} layers; drafter.draft_vocab is sized from the answers by "
        f"`python recipes/run.py {set_dir}` before training (pipeline.yaml: draft_vocab_coverage)\n"
        + yaml.safe_dump(recipe, sort_keys=False)
    )
    (directory / "pipeline.yaml").write_text(
        f"# python recipes/run.py {set_dir}     (self-distil -> extract -> train -> export -> evaluate)\n"
        f"# python recipes/run.py {set_dir} --check     (the set against its target, in seconds)\n"
        + yaml.safe_dump(pipeline, sort_keys=False)
    )
    source = f"{count} prompts from {prompt_file} ({held} held out)" if prompt_file else "ShareGPT's requests"
    return (
        f"{shown(directory)}: EAGLE-3.1 for {target_name} ({config['num_hidden_layers']} layers: fused {layers}), "
        f"{source}; {size['dtype']}, max_len {size['max_len']}, batch {size['batch_size']}, "
        f"{size['max_steps']} steps (to run it again: python recipes/run.py {set_dir})"
    )


def size_draft_vocab(recipe_path: Path, coverage: float, overrides: list[str]) -> str | None:
    """Set `drafter.draft_vocab` of an own-vocabulary recipe (EAGLE-3, P-EAGLE) to the fewest most-frequent answer
    tokens covering `coverage` of them, rewriting the number in the recipe file, unless its training has started
    (its checkpoints keep the vocabulary they were made with). Returns what it did, or None when nothing changed."""
    from data.prepare import prepare_dataset
    from data.shards import split_by_id
    from data.vocab_counts import coverage_size, loss_token_counts
    from methods import METHODS
    from models.target import load_tokenizer
    from rundir.checkpoints import list_checkpoints
    from schema.recipe import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    if not METHODS[recipe.drafter.method].own_vocab or list_checkpoints(recipe.train.output_dir):
        return None
    tokenizer = load_tokenizer(recipe.target.path, recipe.target.tokenizer, recipe.target.trust_remote_code)
    samples = prepare_dataset(recipe.data, tokenizer).samples
    _, heldout = split_by_id([s["id"] for s in samples], recipe.data.heldout_fraction, recipe.train.seed)
    counts = loss_token_counts(samples, skip_ids={samples[i]["id"] for i in heldout})  # the training split's, as
    # training counts them (train.first_records aside)
    floor = max(recipe.eval.tree_top_k, recipe.drafter.topk_metric)
    size = min(max(coverage_size(counts, coverage), floor), int((counts > 0).sum()))
    if size == recipe.drafter.draft_vocab:
        return None
    text = recipe_path.read_text(encoding="utf-8")
    section = re.search(r"^drafter:\n((?:[ \t]+.*\n|\n)*)", text, flags=re.MULTILINE)
    line = re.compile(r"^([ \t]+draft_vocab:[ \t]*)\d+", flags=re.MULTILINE)
    if section is None or not line.search(section.group(1)):
        raise NewSetError(f"{recipe_path}: drafter.draft_vocab: no number to size in its drafter section")
    body = line.sub(lambda m: f"{m.group(1)}{size}", section.group(1), count=1)
    recipe_path.write_text(text[: section.start(1)] + body + text[section.end(1) :], encoding="utf-8")
    was = recipe.drafter.draft_vocab
    return f"{recipe_path}: drafter.draft_vocab: {was} -> {size} ({coverage:.0%} of the answers' tokens)"


def main(directory: Path, target: Path | None, prompt_file: Path | None) -> None:
    if target is None:
        sys.exit("run: --new needs --target MODEL_DIR")
    try:
        print(write_set(directory, target, prompt_file))
    except NewSetError as exc:
        sys.exit(f"run: {exc}")
