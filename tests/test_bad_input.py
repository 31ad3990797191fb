"""Bad input to every CLI: one line on stderr naming the culprit (file, key or sample), a non-zero exit, no Python
traceback, and nothing left behind that looks complete.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_bad_input.py -q

Every case runs its CLI as a subprocess (`python -m ...`) on inputs built once for the module: a tiny random target
saved to disk, a one-step Medusa-1 run and its export, feature shards, and broken copies of each. Arguments are format
strings over those paths (`{m1}` is the Medusa-1 recipe, `{out}` a fresh output path for the case).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from tiny import save_chat_target

ROOT = Path(__file__).resolve().parents[1]
POCKET = ROOT / "recipes" / "pocket" / "target"
GOOD = [  # chats from the tiny fixture: the first line of every broken data file is good
    json.loads(line) for line in (ROOT / "tests" / "fixtures" / "tiny-chat.jsonl").read_text().splitlines()[:12]
]
MARKERS = {  # features, reports, exports, runs
    "manifest.json",
    "report.json",
    "report.md",
    "recipe.yaml",
    "config.json",
    "model.safetensors",
    "checkpoints",
}
"""Files whose presence makes an output look complete (or at least written)."""


@dataclass(frozen=True)
class Case:
    module: str
    args: str
    """Arguments, `{name}` replaced by the module's inputs (see `world`) and `{out}` by this case's output path."""
    culprit: tuple[str, ...]
    """Substrings (formatted like args) of stderr's last line: the file / key / sample, and what is wrong."""
    watch: str = "{out}"
    """An output that must be left as it was (absent, or the pre-existing inputs of a refusal)."""
    absent: tuple[str, ...] = ()
    """Substrings the last line must not hold (unrelated trailing context)."""


M1 = "{m1}"
EVAL = "{m1} eval.prompts={prompts} eval.drafter={export} eval.output_dir={out}"
SELFDISTILL = "--target {target} --prompts {prompts} --out {out}/distilled.jsonl --max-new-tokens 2"
SYNTH = "--target {target} --out {out}/requests.jsonl --count 4 --max-new-tokens 2"
CASES: dict[str, Case] = {
    # data.prepare: recipe, data files, target
    "prepare/unknown-key": Case("data.prepare", f"{M1} data.trian_files=[x]", ("{m1}", "data.trian_files", "unknown")),
    "prepare/no-recipe": Case("data.prepare", "{w}/nope.yaml", ("nope.yaml", "no such recipe file")),
    "prepare/recipe-is-a-directory": Case(
        "data.prepare", "{w}", ("{w}: a directory, not a recipe file (it holds", "bad.yaml")
    ),
    "prepare/recipe-not-yaml": Case("data.prepare", "{w}/bad.yaml", ("bad.yaml", "not valid YAML: line 2, column 1:")),
    "prepare/recipe-not-utf8": Case("data.prepare", "{w}/latin1.yaml", ("latin1.yaml", "not UTF-8")),
    "prepare/missing-data-file": Case(
        "data.prepare", f"{M1} data.train_files=[{{w}}/missing.jsonl]", ("data.train_files[0]", "missing.jsonl")
    ),
    "prepare/not-utf8": Case(
        "data.prepare", f"{M1} data.train_files=[{{w}}/latin1.jsonl]", ("latin1.jsonl:2", "not UTF-8")
    ),
    "prepare/bad-json": Case(
        "data.prepare", f"{M1} data.train_files=[{{w}}/badjson.jsonl]", ("badjson.jsonl:2", "bad JSON")
    ),
    "prepare/empty-assistant-turn": Case(
        "data.prepare", f"{M1} data.train_files=[{{w}}/empty_turn.jsonl]", ("empty_turn.jsonl:2", "empty assistant")
    ),
    "prepare/empty-dataset": Case(
        "data.prepare", f"{M1} data.train_files=[{{w}}/blank.jsonl]", ("data.train_files", "blank.jsonl", "no usable")
    ),
    "prepare/every-record-skipped": Case(
        "data.prepare",
        f"{M1} data.train_files=[{{w}}/malformed.jsonl] data.skip_malformed=true",
        ("malformed.jsonl", "no usable samples", "2 malformed skipped"),
    ),
    "prepare/missing-target": Case(
        "data.prepare", f"{M1} target.random_init= target.path={{w}}/no-target", ("target.path", "no such directory")
    ),
    "prepare/missing-tokenizer": Case(
        "data.prepare", f"{M1} target.tokenizer={{w}}/no-tokenizer", ("target.tokenizer", "no-tokenizer")
    ),
    "prepare/huge-random-target": Case(
        "data.prepare",
        f"{M1} target.random_init.hidden_size=1000000000000",
        ("target.random_init.hidden_size", "upper"),
    ),
    "prepare/max-samples-zero": Case("data.prepare", f"{M1} data.max_samples=0", ("data.max_samples", ">= 1")),
    "prepare/max-loss-tokens-zero": Case(
        "data.prepare", f"{M1} data.max_loss_tokens=0", ("data.max_loss_tokens", ">= 1")
    ),
    "prepare/max-repeat-run-negative": Case(
        "data.prepare", f"{M1} data.max_repeat_run=-1", ("data.max_repeat_run", ">= 0")
    ),
    "prepare/empty-completion": Case(
        "data.prepare",
        f"{M1} data.train_files=[{{w}}/empty_completion.jsonl]",
        ("empty_completion.jsonl:2", "empty completion"),
    ),
    # data.extract
    "extract/unknown-section": Case(
        "data.extract", f"{M1} optimizer.lr=1 data.features_dir={{out}}", ("{m1}", "optimizer", "unknown section")
    ),
    "extract/no-features-dir": Case("data.extract", f"{M1} data.features_dir=null", ("data.features_dir", "required")),
    "extract/missing-data-file": Case(
        "data.extract",
        f"{M1} data.train_files=[{{w}}/missing.jsonl] data.features_dir={{out}}",
        ("data.train_files[0]", "no such file", "missing.jsonl"),
    ),
    "extract/empty-dataset": Case(
        "data.extract",
        f"{M1} data.train_files=[{{w}}/blank.jsonl] data.features_dir={{out}}",
        ("blank.jsonl", "no usable samples"),
    ),
    "extract/features-dir-is-a-file": Case(
        "data.extract",
        f"{M1} data.features_dir={{w}}/good.jsonl",
        ("data.features_dir", "good.jsonl is a file"),
        watch="{w}/good.jsonl",
    ),
    # train: impossible values refused at load, missing inputs
    "train/alias-bomb": Case("train", "{w}/bomb.yaml", ("bomb.yaml", "line 4,", "aliases expand")),
    "train/huge-grad-accum": Case("train", f"{M1} train.grad_accum=1000000000000", ("train.grad_accum", "upper bound")),
    "train/output-dir-is-a-file": Case(
        "train",
        f"{M1} train.output_dir={{w}}/good.jsonl",
        ("train.output_dir", "good.jsonl is a file"),
        watch="{w}/good.jsonl",
    ),
    "train/nan-lr": Case("train", f"{M1} train.lr=nan train.output_dir={{out}}", ("train.lr", "finite", "nan")),
    "train/inf-lr": Case("train", f"{M1} train.lr=.inf train.output_dir={{out}}", ("train.lr", "finite", "inf")),
    "train/negative-save-every": Case("train", f"{M1} train.save_every=-1", ("train.save_every", ">= 0")),
    "train/zero-batch-size": Case("train", f"{M1} train.batch_size=0", ("train.batch_size", ">= 1")),
    "train/negative-max-steps": Case("train", f"{M1} train.max_steps=-5", ("train.max_steps", ">= 1")),
    "train/heldout-fraction-one": Case("train", f"{M1} data.heldout_fraction=1.0", ("data.heldout_fraction", "[0, 1)")),
    "train/nan-beta": Case("train", f"{M1} train.betas=[0.9,.nan]", ("train.betas[1]", "finite")),
    "train/negative-weight-decay": Case("train", f"{M1} train.weight_decay=-0.1", ("train.weight_decay", ">= 0")),
    "train/wrong-type": Case("train", f"{M1} train.max_steps=ten", ("train.max_steps", "expected int")),
    "train/override-without-value": Case("train", f"{M1} train.lr", ("train.lr", "section.key=value")),
    "train/override-not-yaml": Case(
        "train", f"{M1} train.betas=[0.9", ("train.betas=[0.9", "not a YAML value: character 5")
    ),
    "train/features-stored-otherwise": Case(
        "train",
        f"{M1} data.features_dir={{features_fp8}} data.storage_dtype=float32 train.output_dir={{out}}",
        ("{features_fp8}", "dtype='fp8_e4m3'", "data.storage_dtype"),
    ),
    "train/missing-stage1-heads": Case(
        "train",
        "{m2} drafter.stage1_heads={w}/no-stage1 train.output_dir={out}",
        ("drafter.stage1_heads", "no-stage1", "no such file"),
    ),
    "train/stage1-heads-not-heads": Case(
        "train", "{m2} drafter.stage1_heads={w}/good.jsonl", ("drafter.stage1_heads", "good.jsonl", "not a Medusa-1")
    ),
    "train/missing-data-file-online": Case(
        "train",
        f"{M1} train.online=true data.train_files=[{{w}}/missing.jsonl] train.output_dir={{out}}",
        ("data.train_files[0]", "missing.jsonl"),
    ),
    "train/missing-target": Case(
        "train", f"{M1} target.random_init= target.path={{w}}/no-target", ("target.path", "no such directory")
    ),
    "train/target-without-config": Case(
        "train", f"{M1} target.random_init= target.path={{w}}", ("target.path", "{w}", "no config.json")
    ),
    "train/stop-after-zero": Case("train", f"{M1} --stop-after 0", ("--stop-after", ">= 1")),
    # export.write
    "export/no-run-dir": Case("export", "{w}/no-run --out {out}", ("no-run", "no such run directory")),
    "export/truncated-drafter": Case(
        "export", "{run_trunc} --out {out}", ("{run_trunc}/checkpoints/", "drafter.safetensors", "truncated")
    ),
    "export/fasterdecoding-head-count": Case(
        "export", "{run} --format medusa --out {out}", ("drafter.num_heads", "builds 5 heads", "--format vllm")
    ),
    "export/out-is-a-file": Case(
        "export", "{run} --out {w}/good.jsonl", ("good.jsonl", "is a file"), watch="{w}/good.jsonl"
    ),
    # export.imports: FasterDecoding Medusa checkpoints for the tiny target
    "imports/missing-tensor": Case(
        "export.imports",
        "{w}/fd-missing --format medusa --target {m1} --out {out}",
        ("fd-missing/medusa_lm_head.pt", "missing tensors", "4.1.weight"),
    ),
    "imports/extra-tensor": Case(
        "export.imports",
        "{w}/fd-extra --format medusa --target {m1} --out {out}",
        ("fd-extra/medusa_lm_head.safetensors", "extra tensors", "0.0.linear.scale"),
    ),
    "imports/deeply-nested-config": Case(
        "export.imports",
        "{w}/fd-deep --format medusa --target {m1} --out {out}",
        ("fd-deep/config.json", "nested too deeply"),
    ),
    "imports/bad-config": Case(
        "export.imports",
        "{w}/fd-badjson --format medusa --target {m1} --out {out}",
        ("fd-badjson/config.json", "not valid JSON"),
    ),
    # eval
    "eval/missing-prompts": Case(
        "eval", EVAL.replace("{prompts}", "{w}/no-prompts.jsonl"), ("eval.prompts", "no such file", "no-prompts.jsonl")
    ),
    "eval/method-mismatch": Case(
        "eval",
        "{e2} eval.prompts={prompts} eval.drafter={export} eval.output_dir={out} data.features_dir=null",
        ("{export}/config.json", "medusa1", "drafter.method=eagle2"),
    ),
    "eval/truncated-export": Case(
        "eval", EVAL.replace("{export}", "{export_trunc}"), ("{export_trunc}/model.safetensors", "truncated")
    ),
    "eval/output-dir-of-other-settings": Case(
        "eval",
        EVAL.replace("{out}", "{ev_other}"),
        ("{ev_other}", "other settings", "eval.max_new_tokens"),
        watch="{ev_other}",
    ),
    "eval/draft-vocab-too-large": Case(
        "eval",
        f"{EVAL} eval.draft_vocab=8000 data.features_dir={{features}}",
        ("eval.draft_vocab", "8000 asked", "available"),
    ),
    "eval/tree-deeper-than-heads": Case(
        "eval",
        f"{EVAL} drafter.num_heads=4 eval.tree=mc_sim_7b_63 eval.tree_top_k=10 eval.draft_vocab=10 "
        "data.features_dir={features}",
        ("eval", "tree depth 4", "Medusa heads (3)"),
        absent=("{features}",),
    ),
    "eval/endless-decoding": Case(
        "eval", f"{EVAL} eval.max_new_tokens=1000000000000", ("{m1}", "eval.max_new_tokens", "upper bound")
    ),
    # data.selfdistill
    "selfdistill/missing-prompts": Case(
        "data.selfdistill",
        SELFDISTILL.replace("{prompts}", "{w}/no-prompts.jsonl"),
        ("no-prompts.jsonl", "no such prompts file"),
    ),
    "selfdistill/missing-target": Case(
        "data.selfdistill", SELFDISTILL.replace("{target}", "{w}/no-target"), ("no-target", "no such target directory")
    ),
    "selfdistill/not-utf8": Case(
        "data.selfdistill", SELFDISTILL.replace("{prompts}", "{w}/prompts_latin1.jsonl"), ("prompts_latin1.jsonl:2",)
    ),
    "selfdistill/bad-json": Case(
        "data.selfdistill",
        SELFDISTILL.replace("{prompts}", "{w}/prompts_badjson.jsonl"),
        ("prompts_badjson.jsonl:2", "invalid JSON"),
    ),
    "selfdistill/endless-answers": Case(
        "data.selfdistill",
        SELFDISTILL.replace("--max-new-tokens 2", "--max-new-tokens 1000000000000"),
        ("--max-new-tokens 1000000000000", "{target} holds", "positions"),
    ),
    # data.synthesize
    "synthesize/huge-count": Case("data.synthesize", f"{SYNTH} --count 1000000000000", ("--count", "at most")),
    "synthesize/endless-requests": Case(
        "data.synthesize", f"{SYNTH} --max-new-tokens 1000000000000", ("--max-new-tokens 1000000000000", "positions")
    ),
    "synthesize/kinds-not-utf8": Case(
        "data.synthesize", f"{SYNTH} --kinds {{w}}/latin1.yaml", ("latin1.yaml", "not UTF-8")
    ),
    "synthesize/kinds-not-yaml": Case(
        "data.synthesize", f"{SYNTH} --kinds {{w}}/bad.yaml", ("bad.yaml", "not valid YAML: line 2, column 1:")
    ),
    "synthesize/kinds-is-a-directory": Case(
        "data.synthesize", f"{SYNTH} --kinds {{a_dir}}", ("{a_dir}", "is a directory"), watch="{a_dir}"
    ),
    "synthesize/kinds-alias-bomb": Case(
        "data.synthesize", f"{SYNTH} --kinds {{w}}/bomb.yaml", ("bomb.yaml", "aliases expand")
    ),
    # data.chatsets
    "chatsets/missing-source": Case("data.chatsets", "{w}/nope.json --out {out}", ("nope.json", "no such file")),
    "chatsets/malformed": Case(
        "data.chatsets", "{w}/chat-bad.json --out {out}", ("chat-bad.json", "line 4", "malformed JSON in record 0")
    ),
    "chatsets/not-utf8": Case("data.chatsets", "{w}/latin1.jsonl --out {out}", ("latin1.jsonl:2", "not a JSON record")),
    "selfdistill/out-is-a-directory": Case(
        "data.selfdistill", SELFDISTILL.replace("{out}/distilled.jsonl", "{a_dir}"), ("{a_dir}",), watch="{a_dir}"
    ),
}


# --------------------------------------------------------------------------------------------
# Inputs, built once


def _write_jsonl(path: Path, lines: list) -> None:
    """One line per item: bytes and str as they are (broken lines), anything else as JSON."""
    raw = [x if isinstance(x, bytes) else x.encode() if isinstance(x, str) else json.dumps(x).encode() for x in lines]
    path.write_bytes(b"".join(line + b"\n" for line in raw))


def _recipe(path: Path, name: str, **sections) -> str:
    """A tiny recipe with absolute paths (subprocesses and this process agree whatever their directory)."""
    raw = yaml.safe_load((ROOT / "recipes" / "tiny" / f"{name}.yaml").read_text())
    raw["target"]["tokenizer"] = str(POCKET)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    from data.extract import main as extract_main
    from export.write import main as export_main
    from schema.recipe import load_recipe
    from train.__main__ import main as train_main

    torch.set_num_threads(1)
    w = tmp_path_factory.mktemp("bad-input")
    save_chat_target(w / "target", POCKET)
    good = w / "good.jsonl"
    _write_jsonl(good, GOOD)
    _write_jsonl(w / "latin1.jsonl", [GOOD[0], b'{"prompt": "caf\xe9", "completion": "x"}'])
    _write_jsonl(w / "badjson.jsonl", [GOOD[0], '{"conversations": ['])
    empty_turn = {"conversations": [{"from": "human", "value": "Say nothing."}, {"from": "gpt", "value": "  "}]}
    _write_jsonl(w / "empty_turn.jsonl", [GOOD[0], empty_turn])
    (w / "blank.jsonl").write_text("\n\n")
    _write_jsonl(w / "empty_completion.jsonl", [GOOD[0], {"prompt": "Say nothing.", "completion": ""}])
    nine = lambda alias: "[" + ", ".join([alias] * 9) + "]"  # noqa: E731
    levels = [f"&{name} {nine('*' + below)}" for below, name in zip("abcdefgh", "bcdefghi")]
    (w / "bomb.yaml").write_text(  # a 'billion laughs' (9**9 items once expanded) where a number is expected
        "target: {path: x}\ndata: {train_files: [x]}\ntrain:\n  max_steps: [&a " + nine("1") + ", "
        + ", ".join(levels) + "]\ndrafter: {method: medusa1}\n"
    )  # fmt: skip
    _write_jsonl(w / "malformed.jsonl", ["{oops", [1, 2]])
    (w / "bad.yaml").write_text("target: [\n")
    (w / "latin1.yaml").write_bytes(b"target: caf\xe9\n")
    prompts = [{"id": "a", "prompt": "Count to five."}, {"id": "b", "messages": [{"role": "user", "content": "Hi."}]}]
    _write_jsonl(w / "prompts.jsonl", prompts)
    _write_jsonl(w / "prompts_latin1.jsonl", [prompts[0], b'{"prompt": "caf\xe9"}'])
    _write_jsonl(w / "prompts_badjson.jsonl", [prompts[0], '{"prompt": '])
    (w / "a-dir").mkdir()

    data = {"train_files": [str(good)], "features_dir": str(w / "features")}
    paths = {
        "w": str(w),
        "target": str(w / "target"),
        "prompts": str(w / "prompts.jsonl"),
        "a_dir": str(w / "a-dir"),
        "features": str(w / "features"),
        "m1": _recipe(w / "medusa1.yaml", "medusa1", data=data),
        "e2": _recipe(w / "eagle2.yaml", "eagle2", data=data),
        "m2": _recipe(w / "medusa2.yaml", "medusa2", data={"train_files": [str(good)]}),
    }
    # a one-step online Medusa-1 run, its export and feature shards of the same data
    run = w / "run"
    one_step = ["train.online=true", "train.max_steps=1", "train.warmup_steps=0", f"train.output_dir={run}"]
    train_main([paths["m1"], *one_step])
    export_main([str(run)])
    extract_main([paths["m1"]])
    extract_main([paths["m1"], f"data.features_dir={w / 'features-fp8'}", "data.storage_dtype=fp8_e4m3"])
    paths |= {"run": str(run), "export": str(run / "export"), "features_fp8": str(w / "features-fp8")}
    bad_chat = json.dumps([GOOD[0]], indent=1).replace('"conversations":', '"conversations"', 1)
    (w / "chat-bad.json").write_text(bad_chat)

    # FasterDecoding Medusa checkpoints to import: one tensor short (.pt), one too many (.safetensors), bad JSON
    from safetensors.torch import save_file

    tiny = yaml.safe_load(Path(paths["m1"]).read_text())["target"]["random_init"]
    d, vocab = tiny["hidden_size"], tiny["vocab_size"]
    heads = {f"{h}.0.linear.{k}": torch.zeros((d, d) if k == "weight" else (d,)) for h in range(5) for k in
             ("weight", "bias")} | {f"{h}.1.weight": torch.zeros(vocab, d) for h in range(5)}  # fmt: skip
    config = json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 1, "base_model_name_or_path": "x"})
    (w / "fd-deep").mkdir()
    (w / "fd-deep" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    torch.save(heads, w / "fd-deep" / "medusa_lm_head.pt")
    for name in ("fd-missing", "fd-extra", "fd-badjson"):
        (w / name).mkdir()
        (w / name / "config.json").write_text(config if name != "fd-badjson" else config[:-1])
    torch.save({k: v for k, v in heads.items() if k != "4.1.weight"}, w / "fd-missing" / "medusa_lm_head.pt")
    save_file({**heads, "0.0.linear.scale": torch.zeros(d)}, str(w / "fd-extra" / "medusa_lm_head.safetensors"))
    torch.save(heads, w / "fd-badjson" / "medusa_lm_head.pt")

    # broken copies
    shutil.copytree(run, w / "run-trunc", ignore=shutil.ignore_patterns("export"))
    for victim in (w / "run-trunc").glob("checkpoints/*/drafter.safetensors"):
        victim.write_bytes(victim.read_bytes()[:200])
    shutil.copytree(run / "export", w / "export-trunc")
    weights = w / "export-trunc" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    paths |= {"run_trunc": str(w / "run-trunc"), "export_trunc": str(w / "export-trunc")}

    # an evaluation output directory written before, with other settings
    ev_other = w / "ev-other"
    ev_other.mkdir()
    earlier = EVAL.replace("{out}", "{ev_other}").format(**paths, ev_other=ev_other).split()
    load_recipe(earlier[0], [*earlier[1:], "eval.max_new_tokens=7"]).save(ev_other / "recipe.yaml")
    (ev_other / "report.json").write_text("{}\n")
    paths["ev_other"] = str(ev_other)
    return paths


# --------------------------------------------------------------------------------------------
# The cases


def _snapshot(path: Path) -> dict[str, str] | None:
    """sha256 of every file under `path` (or of `path`), None when it does not exist."""
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_naming_the_culprit(world, name, tmp_path):
    case = CASES[name]
    paths = {**world, "out": str(tmp_path / "out")}
    watch = Path(case.watch.format(**paths))
    before = _snapshot(watch)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", case.module, *case.args.format(**paths).split()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    assert proc.returncode != 0, f"{name}: exit 0\n{proc.stdout[-1000:]}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: " in last, proc.stderr[-2000:]
    assert len([line for line in lines if not line.startswith("usage:")]) == 1, proc.stderr[-3000:]
    for culprit in case.culprit:
        assert culprit.format(**paths) in last, f"{culprit.format(**paths)!r} not in {last!r}"
    for unrelated in case.absent:
        assert unrelated.format(**paths) not in last, last
    after = _snapshot(watch)
    if before is not None:
        assert after == before, f"{watch} changed"
    else:
        left = {part for rel in after or {} for part in Path(rel).parts}
        assert not left & MARKERS, f"{watch} holds {sorted(left & MARKERS)}"


def test_cases_cover_every_cli():
    assert {case.module for case in CASES.values()} == {
        "data.prepare",
        "data.selfdistill",
        "data.synthesize",
        "data.chatsets",
        "data.extract",
        "train",
        "export",
        "export.imports",
        "eval",
    }
    assert len(CASES) >= 40


@pytest.mark.slow
def test_an_eval_output_dir_is_reused_only_with_the_same_settings(world, tmp_path):
    """In process (the CLI case above runs one refusal): the same settings replace a report, other settings and a
    report of unknown settings are refused, an empty or absent directory is fine."""
    from eval import EvalError
    from eval.run import check_output_dir
    from schema.recipe import load_recipe

    args = EVAL.format(**world, out=tmp_path / "ev").split()
    recipe = load_recipe(args[0], args[1:])
    check_output_dir(recipe, str(tmp_path / "ev"))  # absent
    (tmp_path / "ev").mkdir()
    check_output_dir(recipe, str(tmp_path / "ev"))  # empty
    (tmp_path / "ev" / "report.json").write_text("{}\n")
    with pytest.raises(EvalError, match=r"ev holds report.json of an evaluation with unknown settings"):
        check_output_dir(recipe, str(tmp_path / "ev"))
    recipe.save(tmp_path / "ev" / "recipe.yaml")
    check_output_dir(recipe, str(tmp_path / "ev"))  # the same settings: replaced
    moved = load_recipe(args[0], [*args[1:], f"eval.output_dir={tmp_path / 'elsewhere'}"])
    check_output_dir(moved, str(tmp_path / "ev"))  # where the report goes is not a setting of it
    other = load_recipe(args[0], [*args[1:], "eval.tree_depth=2"])
    with pytest.raises(EvalError, match=r"other settings \(eval.tree_depth: 3 there, 2 in "):
        check_output_dir(other, str(tmp_path / "ev"))
