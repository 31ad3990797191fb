"""A DFlash export served by vLLM's own engine (its CPU build, `.venv-vllm`): vLLM's acceptance length against this
project's evaluation of the same drafter, on the same tokenized prompts, greedy.

    .venv/bin/python -m methods.dflash.check_vllm prepare RUN_DIR OUT [--prompts P.jsonl] [--max-prompts N]
    .venv-vllm/bin/python methods/dflash/check_vllm.py consume OUT [--max-new-tokens 128]

`prepare` (this project's environment) exports the run in the speculators layout (OUT/export) and writes the eval
prompts (the run's recipe's, or `--prompts`) as its target tokenizes them (OUT/prompts.json: token ids after the
chat template) with the target's directory and the drafter's block. `consume` (vLLM's environment; nothing of
this project) starts `LLM(model=TARGET, dtype=float32, speculative_config={"method": "dflash", "model": OUT/export,
"num_speculative_tokens": block_size - 1})`, generates greedily from those token ids and reads vLLM's counters:
acceptance length = 1 + accepted / drafts (what `python -m eval` reports as τ with `eval.tree=chain`,
`eval.tree_depth=block_size - 1`). It prints τ and the per-position acceptance; the evaluation's τ on the same
prompts is the comparison (docs/components.md, DFlash).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def prepare(run: str, out: Path, prompts: str | None, max_prompts: int) -> None:
    from eval.prompts import load_prompts
    from export.write import export, load_run

    recipe, target, drafter = load_run(run)
    out.mkdir(parents=True, exist_ok=True)
    export(run, out / "export", fmt="speculators")
    rows = load_prompts(prompts or recipe.eval.prompts, target.tokenizer, max_prompts)
    record = {
        "target": str(Path(recipe.target.path).resolve()),
        "block_size": drafter.cfg.block_size,
        "prompts": [{"id": r["id"], "input_ids": list(map(int, r["input_ids"]))} for r in rows],
    }
    (out / "prompts.json").write_text(json.dumps(record) + "\n")
    print(f"prepared {out}: {len(rows)} prompts, block {drafter.cfg.block_size}")


def consume(out: Path, max_new_tokens: int) -> None:
    os.environ.update({"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                       "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # fmt: skip
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    record = json.loads((out / "prompts.json").read_text())
    K = record["block_size"] - 1
    spec = {"method": "dflash", "model": str((out / "export").resolve()), "num_speculative_tokens": K}
    llm = LLM(model=record["target"], dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              max_num_seqs=1, disable_log_stats=False, speculative_config=spec)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=False)
    for p in record["prompts"]:
        llm.generate([TokensPrompt(prompt_token_ids=p["input_ids"])], params, use_tqdm=False)
    counts = {m.name: m for m in llm.get_metrics() if "spec_decode" in m.name}
    drafts = counts["vllm:spec_decode_num_drafts"].value
    accepted = counts["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = counts["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    tau = 1 + accepted / max(drafts, 1)
    print(f"vLLM dflash: {len(record['prompts'])} prompts, {drafts} drafts of {K}, accepted per position {per_pos}")
    print(f"vllm/dflash_tau: {tau:.3f}")


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        args = sys.argv[2:]
        prompts = args[args.index("--prompts") + 1] if "--prompts" in args else None
        limit = int(args[args.index("--max-prompts") + 1]) if "--max-prompts" in args else 20
        prepare(args[0], Path(args[1]), prompts, limit)
    else:
        n = int(sys.argv[sys.argv.index("--max-new-tokens") + 1]) if "--max-new-tokens" in sys.argv else 128
        consume(Path(sys.argv[2]), n)
