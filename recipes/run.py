"""The whole pipeline for a recipe set: self-distil -> extract -> train -> export -> evaluate, then one table.

    python recipes/run.py recipes/smollm2                  # SmolLM2-135M-Instruct: hours on 2 CPU cores
    python recipes/run.py recipes/smollm2 --ship           # ... and copy the exports into the set (PROVENANCE.json)
    python recipes/run.py recipes/smollm2 --shipped        # only evaluate the drafters shipped in the set
    python recipes/run.py my-recipes/ --methods eagle2 --large-trees
    python recipes/run.py recipes/smollm2 train.max_steps=200 eval.max_prompts=8   # overrides for every recipe
    python recipes/run.py my-set --new --target DIR [--prompt-file P.jsonl]   # write a set for a target, run it

A recipe set is a directory with `pipeline.yaml` and one training recipe per method; `pipeline.yaml` says

    target: artifacts/smollm2-135m-instruct     # the HF directory every recipe of the set names in target.path
    fetch: smollm2-135m-instruct                # optional: `python -m models.fetch NAME` when the target is missing
    chatsets:                                   # optional: prompts from a chat dataset (data.chatsets)
      source: sharegpt                          # a JSON / JSONL file of conversations, or a packaged dataset name
      out: artifacts/smollm2-run/sharegpt       # train.jsonl, heldout.jsonl, train-conversations.jsonl, report.json
      exclude: [recipes/smollm2/prompts/mtbench.jsonl]   # benchmark questions kept out of both splits
      max_user_turns: 2                         # (and heldout_fraction, min_words, max_words, language, near_duplicate)
    synthesize:                                 # optional first step: the target writes user requests itself
      out: artifacts/smollm2-run/synth-prompts.jsonl   # (data.synthesize: no prompt dataset needed)
      count: 4224                               # candidates; the filtered ones go to `out`
      kinds: recipes/smollm2/prompts/synth_kinds.yaml  # optional steering (and max_new_tokens, batch_size, dtype,
      processes: 2                              # temperature, top_p, seed, min_words, max_words, language, ...)
    selfdistill:                                # the target writes the answers the drafters learn (data.selfdistill)
      prompts: recipes/smollm2/prompts/train.jsonl
      out: artifacts/smollm2-run/selfdistill.jsonl   # the recipes' data.train_files
      limit: 1536                               # the first N prompts
      max_new_tokens: 160
      batch_size: 32
      dtype: bfloat16
      processes: 2                              # `accelerate launch` processes (CPU: gloo)
      engine: hf                                # or vllm (engine_python, engine_args: see data.selfdistill)
    # or a list of such jobs, each with its own prompts and out (e.g. a dataset's prompts and synthesize's out)
    recipes: {eagle2: recipes/smollm2/eagle2.yaml, medusa1: recipes/smollm2/medusa1.yaml}
    shipped: {eagle2: recipes/smollm2/drafters/eagle2}   # optional: committed exports, for --shipped
    shipped_overrides: {medusa1: [eval.tree=chain]}      # optional: eval overrides for --shipped, per method
    draft_vocab_coverage: 0.99                  # optional: size own-vocabulary drafters from the answers (new.py)
    general: {prompts: recipes/smollm2/prompts/mtbench.jsonl, max_prompts: 8}   # optional: every method evaluated
                                                # on these too; the table gains their τ and speedup (general chat)
    large_trees:                                # optional, for --large-trees: name -> [method, [overrides]]
      eagle2-dynamic-d5-k10-n60: [eagle2, [eval.tree=dynamic, eval.tree_depth=5, eval.tree_top_k=10]]
    sweep:                                      # optional, always evaluated (the same form): configurations that
      eagle3-lookup: [eagle3, [eval.lookup_tokens=10]]   # can win, which the closing "What to serve" weighs too
    extra_evals:                                # optional, for --extra-evals: the same form
      eagle2-mtbench: [eagle2, [eval.prompts=recipes/smollm2/prompts/mtbench.jsonl, eval.max_prompts=80]]

(The bundled pocket target has its own driver: `make demo-pocket`, recipes/pocket/demo.py.)

Every step is a subprocess with its log under <first recipe's output parent>/logs/ (or --out); re-running resumes
(training from its last checkpoint) and redoes what is stale (below). Recipes that name the same `data.features_dir`
share its features (the first of them extracts them: they must agree on target, data and layers); EAGLE-3, which
stores other layers, names its own. Self-distillation and extraction always run: they keep what is complete and
refuse outputs made with other settings; training is skipped once its export holds the recipe's `train.max_steps` (a
larger one resumes it); an evaluation once its report is newer than the drafter and the recipe. A report newer than
both but made with other settings (other overrides) is kept, never replaced: the run says so and uses it; `--out
DIR` evaluates elsewhere. `key=value` overrides after the set go to every recipe's extraction, training and
evaluation. Prompt lookup is measured with the evaluations of the set's first recipe (and its general prompts),
whatever `--methods` selects; logs are named by what a step writes. The table gives, per method, τ, acceptance by
depth, tokens/s and the speedup over plain decoding (each evaluation's own), with rows for plain decoding and prompt
lookup from the first evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from methods import METHODS
from recipes.preflight import check_set
from recipes.ship import PIPELINE, ship, ship_dir_problem
from recipes.steps import (
    ROOT,
    banner,
    clear_report,
    run_step,
    shown,
    skip,
    trained,
)
from recipes.summary import GENERAL, heading, table, verdict
from schema.parse import RecipeError, YAMLTooLarge, apply_overrides, safe_load, yaml_problem

SELFDISTILL_KEYS = {
    "prompts", "out", "limit", "max_new_tokens", "batch_size", "dtype", "processes", "temperature", "engine",
    "engine_python", "engine_args",
}  # fmt: skip
CHATSETS_KEYS = {
    "source", "out", "exclude", "heldout_fraction", "max_user_turns", "min_words", "max_words", "language",
    "near_duplicate",
}  # fmt: skip
SYNTHESIZE_KEYS = {
    "out", "count", "kinds", "max_new_tokens", "batch_size", "dtype", "processes", "temperature", "top_p", "seed",
    "min_words", "max_words", "language", "near_duplicate",
}  # fmt: skip


def load_pipeline(directory: Path) -> dict[str, Any]:
    """pipeline.yaml of a recipe set, checked; errors name the file and key."""
    path = directory / PIPELINE
    if not path.is_file():
        sys.exit(f"run: {path}: no such file (a recipe set is a directory with {PIPELINE}; see --help)")
    where = shown(path)
    spec = read_yaml(path, where)
    if not isinstance(spec, dict):
        sys.exit(f"run: {where}: a mapping of settings, got {type(spec).__name__}")
    known = {"target", "fetch", "synthesize", "selfdistill", "recipes", "shipped", "shipped_overrides", "large_trees"}
    known |= {"extra_evals", "chatsets", "general", "draft_vocab_coverage", "sweep"}
    unknown = set(spec) - known
    if unknown:
        sys.exit(f"run: {where}: unknown keys {sorted(unknown)}")
    if not isinstance(spec.get("target"), str):
        sys.exit(f"run: {where}: target: must name the target's HF directory")
    if not isinstance(spec.get("recipes"), dict) or not spec["recipes"]:
        sys.exit(f"run: {where}: recipes: must map each method to its recipe file")
    for method, recipe in spec["recipes"].items():
        if not isinstance(recipe, str) or not (ROOT / recipe).is_file():
            sys.exit(f"run: {where}: recipes.{method}: {recipe} does not exist")
    sets = listed(spec, "chatsets", where)
    for i, chatset in enumerate(sets):
        key = "chatsets" if len(sets) == 1 else f"chatsets[{i}]"
        if not isinstance(chatset, dict) or set(chatset) - CHATSETS_KEYS or not {"source", "out"} <= set(chatset):
            sys.exit(f"run: {where}: {key}: needs source and out, and takes the keys {sorted(CHATSETS_KEYS)}")
        if not isinstance(chatset.get("exclude", []), list):
            sys.exit(f"run: {where}: {key}.exclude: a list of prompt files")
    coverage = spec.get("draft_vocab_coverage")
    if coverage is not None and not (isinstance(coverage, (int, float)) and 0 < coverage <= 1):
        sys.exit(f"run: {where}: draft_vocab_coverage: a fraction in (0, 1], got {coverage!r}")
    if spec.get("fetch") is not None and not isinstance(spec["fetch"], str):
        sys.exit(f"run: {where}: fetch: must name a target models.fetch knows")
    for key in ("shipped", "shipped_overrides", "large_trees", "extra_evals", "sweep"):
        value = spec.get(key)
        if value is not None and (not isinstance(value, dict) or not all(isinstance(k, str) for k in value)):
            sys.exit(f"run: {where}: {key}: must map names to settings")
    if not all(isinstance(v, str) for v in (spec.get("shipped") or {}).values()):
        sys.exit(f"run: {where}: shipped: must map each method to a directory")
    if not all(_strings(v) for v in (spec.get("shipped_overrides") or {}).values()):
        sys.exit(f"run: {where}: shipped_overrides: must map each method to a list of key=value overrides")
    for key in ("large_trees", "extra_evals", "sweep"):
        for name, entry in (spec.get(key) or {}).items():
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and _strings(entry[1])):
                sys.exit(f"run: {where}: {key}.{name}: must be [method, [key=value overrides]]")
    general = spec.get("general")
    if general is not None and (
        not isinstance(general, dict)
        or set(general) - {"prompts", "max_prompts"}
        or not isinstance(general.get("prompts"), str)
        or not isinstance(general.get("max_prompts", 8), int)
    ):
        sys.exit(f"run: {where}: general: needs prompts (a prompt file) and takes max_prompts (a number)")
    synth = spec.get("synthesize")
    if synth is not None and (not isinstance(synth, dict) or set(synth) - SYNTHESIZE_KEYS):
        sys.exit(f"run: {where}: synthesize: takes the keys {sorted(SYNTHESIZE_KEYS)}")
    if synth is not None and not {"out", "count"} <= set(synth):
        sys.exit(f"run: {where}: synthesize: needs out and count")
    jobs = listed(spec, "selfdistill", where)
    for i, distill in enumerate(jobs):
        key = "selfdistill" if len(jobs) == 1 else f"selfdistill[{i}]"
        if not isinstance(distill, dict) or set(distill) - SELFDISTILL_KEYS:
            sys.exit(f"run: {where}: {key}: takes the keys {sorted(SELFDISTILL_KEYS)}")
        if not {"prompts", "out"} <= set(distill):
            sys.exit(f"run: {where}: {key}: needs prompts and out")
        for name in ("prompts", "out"):
            if not isinstance(distill[name], str):
                sys.exit(f"run: {where}: {key}: {name}: expected a file path, got {distill[name]!r:.80}")
    outs = [d["out"] for d in jobs]
    if len(set(outs)) < len(outs):
        sys.exit(f"run: {where}: selfdistill: two jobs write the same out")
    return spec


def listed(spec: dict[str, Any], key: str, where: str) -> list:
    """`spec[key]`, a mapping of settings or a list of them, as a list (stored back); [] when absent."""
    value = spec.get(key)
    if isinstance(value, dict):
        spec[key] = value = [value]
    if value is not None and not isinstance(value, list):
        sys.exit(f"run: {where}: {key}: a mapping of settings, or a list of them")
    return value or []


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def eval_dir_of(conf: dict[str, Any]) -> Path:
    """A recipe's `eval.output_dir`, or eval's default `<train.output_dir>/eval`."""
    return Path((conf.get("eval") or {}).get("output_dir") or Path(conf["train"]["output_dir"]) / "eval")


def read_yaml(path: Path, where: str) -> Any:
    """A YAML file's content (empty: {}), read with the recipes' bounded loader (aliases expand to at most
    `MAX_YAML_NODES` nodes); what cannot be read exits with one line naming the file."""
    try:
        return safe_load(path.read_text(encoding="utf-8")) or {}
    except YAMLTooLarge as exc:
        sys.exit(f"run: {where}: {exc}")
    except yaml.YAMLError as exc:
        sys.exit(f"run: {where}: not valid YAML: {yaml_problem(exc)}")
    except (OSError, UnicodeDecodeError) as exc:
        sys.exit(f"run: {where}: cannot be read ({exc.__class__.__name__}: {exc})")


def read_recipe(path: str, overrides: list[str] = ()) -> dict[str, Any]:
    """A recipe of the set as a mapping, the command line's `key=value` overrides applied (as every step gets them)."""
    conf = read_yaml(ROOT / path, path)
    if overrides and isinstance(conf, dict):
        try:
            conf = apply_overrides(conf, list(overrides), path)
        except RecipeError as exc:
            sys.exit(f"run: {exc}")
    if not isinstance(conf, dict) or not isinstance(conf.get("train"), dict) or "output_dir" not in conf["train"]:
        sys.exit(f"run: {path}: train.output_dir: is required by the pipeline (each recipe's run directory)")
    return conf


def launch_cmd(module: str, settings: dict[str, Any], target: str, flags: list[str]) -> list[str]:
    """`python -m MODULE --target TARGET --key value ...` for the `flags` set in `settings`, through `accelerate
    launch` when `settings` asks for several processes."""
    py, n = sys.executable, int(settings.get("processes", 1))
    launch = [py, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(n), "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd = (launch if n > 1 else [py]) + ["-m", module, "--target", target]
    for key in flags:
        if key in settings:
            cmd += [f"--{key.replace('_', '-')}", str(settings[key])]
    return cmd


def selfdistill_cmd(distill: dict[str, Any], target: str) -> list[str]:
    flags = ["prompts", "out", "seed", "limit", "max_new_tokens", "batch_size", "dtype", "temperature", "engine"]
    flags += ["engine_python", "engine_args"]
    settings = {"seed": 0} | distill
    if isinstance(settings.get("engine_args"), dict):  # a mapping in YAML, JSON on the command line
        settings["engine_args"] = json.dumps(settings["engine_args"])
    return launch_cmd("data.selfdistill", settings, target, flags)


def chatsets_cmd(chatset: dict[str, Any], target: str) -> list[str]:
    cmd = [sys.executable, "-m", "data.chatsets", str(chatset["source"]), "--out", str(chatset["out"])]
    cmd += [arg for path in chatset.get("exclude", []) for arg in ("--exclude", str(path))]
    for key in sorted(CHATSETS_KEYS - {"source", "out", "exclude"}):
        if key in chatset:
            cmd += [f"--{key.replace('_', '-')}", str(chatset[key])]
    return cmd + (["--target", target] if int(chatset.get("max_user_turns", 1)) > 1 else [])


def synthesize_cmd(synth: dict[str, Any], target: str) -> list[str]:
    return launch_cmd("data.synthesize", {"seed": 0} | synth, target, sorted(SYNTHESIZE_KEYS - {"processes"}))


def reads_target_statistics(conf: dict[str, Any]) -> bool:
    """Whether a recipe's drafter trains from the target's stored statistics (`data.target_stats`)."""
    method = METHODS.get((conf.get("drafter") or {}).get("method"))
    return method is not None and method.target_statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe_set", type=Path, help="a directory with pipeline.yaml, e.g. recipes/smollm2")
    parser.add_argument("--new", action="store_true", help="write a set for --target into RECIPE_SET, then run it")
    parser.add_argument("--target", type=Path, default=None, help="--new: the target's HF directory")
    parser.add_argument("--prompt-file", type=Path, default=None, help="--new: JSONL prompts (default: ShareGPT's)")
    parser.add_argument("overrides", nargs="*", help="section.key=value for every recipe of the set (train, eval, ...)")
    parser.add_argument("--methods", nargs="*", default=None, help="default: every recipe of the set")
    parser.add_argument("--shipped", action="store_true", help="evaluate the set's shipped drafters; train nothing")
    parser.add_argument("--large-trees", action="store_true", help="also evaluate the set's large_trees")
    parser.add_argument("--extra-evals", action="store_true", help="also the set's extra_evals (MT-bench, sampling)")
    parser.add_argument("--ship", action="store_true", help="copy the trained exports to the set's `shipped` dirs")
    parser.add_argument("--prompts", type=int, default=None, help="held-out prompts per evaluation (recipe's default)")
    parser.add_argument("--out", type=Path, default=None, help="evaluation outputs (default: the recipes' eval dirs)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for decoding (self-distil, eval)")
    parser.add_argument("--train-threads", type=int, default=1, help="for extraction and training")
    parser.add_argument("--check", action="store_true", help="check the set against its target and stop (seconds)")
    args = parser.parse_intermixed_args()  # overrides may follow the options
    if args.new:  # write the set, then run it (with --check: check it and stop)
        from recipes.new import main as new_set

        new_set(args.recipe_set, args.target, args.prompt_file)
    elif args.target is not None or args.prompt_file is not None:
        sys.exit("run: --target and --prompt-file go with --new")
    if args.methods:  # `--methods eagle3 train.max_steps=10`: the list ends where the overrides begin
        args.overrides += [m for m in args.methods if "=" in m]
        args.methods = [m for m in args.methods if "=" not in m] or None

    directory = args.recipe_set if args.recipe_set.is_absolute() else ROOT / args.recipe_set
    spec = load_pipeline(directory)
    methods = args.methods or list(spec["recipes"])
    for method in methods:
        if method not in spec["recipes"]:
            sys.exit(f"run: {directory / PIPELINE}: no recipe for method {method!r} (has {sorted(spec['recipes'])})")
        if args.shipped and method not in (spec.get("shipped") or {}):
            sys.exit(f"run: {directory / PIPELINE}: shipped: has no drafter for {method!r}")
        if args.ship and method not in (spec.get("shipped") or {}):
            sys.exit(f"run: {directory / PIPELINE}: shipped: has no directory for {method!r}")
        if args.ship and (problem := ship_dir_problem(ROOT / spec["shipped"][method])) is not None:
            sys.exit(f"run: {directory / PIPELINE}: shipped.{method}: {problem}")  # before hours of training
    recipes = {m: spec["recipes"][m] for m in methods}
    confs = {m: read_recipe(path, args.overrides) for m, path in recipes.items()}  # each recipe read once
    # always, before the first step: a configuration error surfaces in seconds, not after hours of self-distillation
    problems = check_set(spec, directory, recipes, args.overrides, shipped=args.shipped)
    if problems:
        sys.exit("\n".join(f"run: {p}" for p in problems) + f"\nrun: {shown(directory)}: {len(problems)} problem(s)")
    if args.check:
        print(f"run: {shown(directory)}: {len(recipes)} recipe(s) checked against {spec['target']}: no problems")
        return
    first = next(iter(confs.values()))
    if args.shipped and args.out is None:  # keep the evaluation of shipped drafters apart from a training run's
        args.out = Path("artifacts") / f"{directory.name}-shipped"
    out_root = args.out or Path(first["train"]["output_dir"]).parent
    log_dir = (out_root if out_root.is_absolute() else ROOT / out_root) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    train_env = {**env, "OMP_NUM_THREADS": str(args.train_threads)}
    distill_env = {**env, "ACCELERATE_USE_CPU": os.environ.get("ACCELERATE_USE_CPU", "true")}
    py, start = sys.executable, time.perf_counter()

    banner(f"target: {spec['target']}")
    if (ROOT / spec["target"] / "config.json").is_file():
        skip(spec["target"])
    elif spec.get("fetch"):
        run_step("fetch", [py, "-m", "models.fetch", spec["fetch"], "--out", spec["target"]], log_dir, env)
    else:
        sys.exit(f"run: {spec['target']}: no target there (config.json missing), and the set names no `fetch`")

    if not args.shipped:
        for chatset in spec.get("chatsets") or ():
            banner(f"prompts from {chatset['source']} into {chatset['out']}")
            # always run: it reads the dataset again in seconds and writes the same splits
            run_step(f"chatsets-{Path(chatset['out']).name}", chatsets_cmd(chatset, spec["target"]), log_dir, env)
        synth = spec.get("synthesize")
        if synth is not None:
            banner(f"synthesis: the target writes {synth['count']} candidate requests into {synth['out']}")
            # always run: it generates only the candidates still missing and filters them again (cheap)
            run_step("synthesize", synthesize_cmd(synth, spec["target"]), log_dir, distill_env)
        jobs = spec.get("selfdistill") or []
        for distill in jobs:
            banner(f"self-distillation: the target answers {distill['prompts']} ({distill.get('limit', 'all')})")
            # always run: it writes only the records still missing, and refuses a file made with other prompts,
            # settings or another target (a count of records would not see those)
            step = f"selfdistill-{Path(distill['out']).stem}"  # named by what it writes, whatever --methods says
            run_step(step, selfdistill_cmd(distill, spec["target"]), log_dir, distill_env)

        if spec.get("draft_vocab_coverage"):  # own-vocabulary drafters sized from the answers, before training
            from recipes.new import size_draft_vocab

            for method, recipe in recipes.items():
                if (done := size_draft_vocab(ROOT / recipe, spec["draft_vocab_coverage"], args.overrides)) is not None:
                    print(f"  {done}", flush=True)
                    confs[method] = read_recipe(recipe, args.overrides)

        by_dir: dict[str, str] = {}  # features_dir -> the first method whose recipe names it extracts them for all
        for method, conf in confs.items():
            if (conf.get("data") or {}).get("features_dir"):  # none: the recipe trains online
                by_dir.setdefault(conf["data"]["features_dir"], method)
        for features_dir, method in by_dir.items():
            banner(f"feature extraction into {features_dir} ({recipes[method]})")
            # always run: complete shards are kept, and shards of other data (a larger self-distillation, another
            # target) are refused rather than trained on
            step = f"extract-{Path(features_dir).name}"
            run_step(step, [py, "-m", "data.extract", recipes[method], *args.overrides], log_dir, train_env)
            # the target's top-1 and logsumexp at every loss position, stored once for the drafters that read them
            # (data.target_stats: ~15% of an EAGLE-3 step on a CPU); always run: it computes only what is missing
            readers = [m for m, conf in confs.items() if (conf.get("data") or {}).get("features_dir") == features_dir
                       and reads_target_statistics(conf)]  # fmt: skip
            if readers:
                stats_cmd = [py, "-m", "data.target_stats", recipes[readers[0]], *args.overrides]
                run_step(f"target-stats-{Path(features_dir).name}", stats_cmd, log_dir, train_env)

        for method, recipe in recipes.items():
            banner(f"train + export {method} ({recipe})")
            run_dir = confs[method]["train"]["output_dir"]
            if trained(ROOT / run_dir, int(confs[method]["train"].get("max_steps", 100))):
                skip(f"{run_dir}/export")
                continue
            train_cmd = [py, "-m", "train", recipe, "train.resume=auto", *args.overrides]
            run_step(f"train-{method}", train_cmd, log_dir, train_env)
            run_step(f"export-{method}", [py, "-m", "export", run_dir], log_dir, env)

    if args.ship:
        for method in methods:
            ship(spec, method, confs[method], directory)

    evals: dict[str, tuple[str, list[str]]] = {m: (m, []) for m in methods}
    general = spec.get("general")
    lookup_method = next(iter(spec["recipes"]))  # prompt lookup is measured once per prompt set, whatever --methods
    for method in methods if general else ():  # the same drafters on general requests too
        limit = [f"eval.max_prompts={general.get('max_prompts', 8)}"]
        lookup = "eval.baselines=[plain,prompt_lookup]" if method == lookup_method else "eval.baselines=[plain]"
        evals[f"{method}{GENERAL}"] = (method, [f"eval.prompts={general['prompts']}", *limit, lookup])
    for key, wanted in (("sweep", True), ("large_trees", args.large_trees), ("extra_evals", args.extra_evals)):
        for name, (method, overrides) in (spec.get(key) or {}).items() if wanted else ():
            if method in methods:
                evals[name] = (method, list(overrides))
    reports: dict[str, dict[str, Any]] = {}
    for name, (method, overrides) in evals.items():
        recipe, conf = recipes[method], confs[method]
        eval_dir = Path(args.out / name) if args.out else eval_dir_of(conf).parent / f"eval-{name}"
        if name == method and args.out is None:
            eval_dir = eval_dir_of(conf)
        keys = [f"eval.output_dir={eval_dir}"]
        if name != lookup_method:  # prompt lookup is measured once, with the set's first recipe's evaluation; plain
            keys.append("eval.baselines=[plain]")  # decoding by every evaluation (its overrides may say more)
        if args.shipped:  # without the training data: e.g. no Medusa tree calibration on its held-out samples
            keys.append(f"eval.drafter={spec['shipped'][method]}")
            keys += (spec.get("shipped_overrides") or {}).get(method, [])
        if args.prompts:
            keys.append(f"eval.max_prompts={args.prompts}")
        keys += [*overrides, *args.overrides]
        banner(f"eval {name}: speculative vs plain decoding on held-out prompts")
        report = ROOT / eval_dir / "report.json"
        drafter = ROOT / (spec["shipped"][method] if args.shipped else Path(conf["train"]["output_dir"]) / "export")
        newest_input = max((drafter / "config.json").stat().st_mtime, (ROOT / recipe).stat().st_mtime)
        fresh = report.is_file() and report.stat().st_mtime > newest_input  # an edited recipe is evaluated again
        recorded = json.loads(report.read_text()).get("overrides") if fresh else None
        if fresh and recorded == keys:
            skip(f"{eval_dir}/report.json")
        elif fresh:  # a finished report of this drafter with other settings is kept, never replaced
            print(f"  kept: {eval_dir}/report.json was made with other settings ({recorded}); to evaluate with "
                  f"these ({keys}), give its evaluations a directory of their own with --out", flush=True)  # fmt: skip
        else:
            clear_report(ROOT / eval_dir)
            run_step(f"eval-{name}", [py, "-m", "eval", recipe, *keys], log_dir, env)
            summary = json.loads(report.read_text())
            report.write_text(json.dumps(summary | {"overrides": keys}, indent=1) + "\n")
        reports[name] = json.loads(report.read_text())

    banner(f"{directory.name}: {heading(next(iter(reports.values())))}")
    print(table(reports))
    if args.shipped:
        runs = {m: (spec["shipped"][m], f"{out_root}/{m}-vllm") for m in confs}
    else:
        runs = {m: (str(c["train"]["output_dir"]), f"{c['train']['output_dir']}/export-vllm") for m, c in confs.items()}
    print("\n" + verdict(reports, {n: m for n, (m, _) in evals.items()}, spec["target"], runs,
                          {n: o for n, (_, o) in evals.items()}))  # fmt: skip
    print(f"\nReports: <eval dir>/report.md (+ report.png). Total {time.perf_counter() - start:.0f}s.")


if __name__ == "__main__":
    main()
