"""recipes/run.py end to end on a tiny recipe set: a random 2-layer target saved to disk, self-distillation with two
processes, extraction, EAGLE-2 and Medusa-1 training and export, evaluation, the table; then a re-run that skips
every step, and --shipped on the exports."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny import save_chat_target

ROOT = Path(__file__).resolve().parents[1]
POCKET = ROOT / "recipes" / "pocket" / "target"
METHODS = ("eagle2", "medusa1", "eagle3")  # EAGLE-3 stores other layers: its own features, extracted separately


def recipe(method: str, root: Path, target: Path) -> dict:
    drafter = {
        "eagle2": {"method": "eagle2", "feature_layers": [-1]},
        "medusa1": {"method": "medusa1", "num_heads": 2, "share_lm_head": True},
        "eagle3": {"method": "eagle3", "feature_layers": [0, 1, -1], "draft_vocab": 32, "ttt_steps": 2},
    }[method]
    layers, features = ([0, 1, -1], "features-eagle3") if method == "eagle3" else ([-1], "features")
    tree = {"tree": "dynamic", "tree_depth": 2, "tree_top_k": 2, "tree_total_tokens": 4}
    if method == "medusa1":
        tree = {"tree": "chain", "tree_depth": 2}
    return {
        "target": {"path": str(target), "dtype": "float32"},
        "data": {
            "train_files": [str(root / "out" / "selfdistill.jsonl")],
            "max_len": 64,
            "layers": layers,
            "features_dir": str(root / "out" / features),
            "storage_dtype": "float32",
            "shard_tokens": 2048,
            "heldout_fraction": 0.2,
        },
        "drafter": drafter,
        "train": {
            "output_dir": str(root / "out" / method),
            "max_steps": 3,
            "batch_size": 2,
            "save_every": 0,
            "eval_batches": 1,
            **({} if method == "eagle3" else {"loss_vocab": 64}),
        },
        "eval": {
            "prompts": str(root / "heldout.jsonl"),
            "output_dir": str(root / "out" / method / "eval"),
            "max_prompts": 2,
            "max_new_tokens": 8,
            **({} if method == "eagle3" else {"draft_vocab": 32}),
            "kernels": "reference",
            **tree,
        },
        "logging": {"tracker": "none"},
    }


@pytest.fixture(scope="module")
def recipe_set(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    target = root / "target"
    save_chat_target(target, POCKET)
    prompts = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]}
               for i in range(10)]  # fmt: skip
    (root / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts[:8]))
    (root / "heldout.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts[8:]))
    for method in METHODS:
        (root / f"{method}.yaml").write_text(yaml.safe_dump(recipe(method, root, target)))
    pipeline = {
        "target": str(target),
        "selfdistill": {
            "prompts": str(root / "train.jsonl"),
            "out": str(root / "out" / "selfdistill.jsonl"),
            "limit": 8,
            "max_new_tokens": 12,
            "batch_size": 2,
            "processes": 2,
        },
        "recipes": {m: str(root / f"{m}.yaml") for m in METHODS},
        "shipped": {m: str(root / "shipped" / m) for m in METHODS},
    }
    (root / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    return root


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "recipes/run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_the_driver_runs_every_step_then_resumes_by_skipping_them(recipe_set):
    first = run(str(recipe_set), "--ship").stdout
    out = recipe_set / "out"
    records = [json.loads(line) for line in (out / "selfdistill.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all("assistant_ids" in r for r in records)
    assert json.loads((out / "features-eagle3" / "manifest.json").read_text())["layers"] == [0, 1, -1]
    assert json.loads((out / "features" / "manifest.json").read_text())["layers"] == [-1]
    stats = json.loads((out / "features-eagle3" / "target-stats" / "index.json").read_text())  # EAGLE-3 reads them
    assert len(stats["shards"]) == len(json.loads((out / "features-eagle3" / "manifest.json").read_text())["shards"])
    assert not (out / "features" / "target-stats").exists()  # EAGLE-2 and Medusa do not
    for method in METHODS:
        assert (out / method / "export" / "draft_vocab.safetensors").is_file()
        report = json.loads((out / method / "eval" / "report.json").read_text())
        assert report["num_prompts"] == 2 and report["lossless"] is True
    # the baselines are measured once, with the first drafter
    assert "prompt_lookup" not in json.loads((out / "medusa1" / "eval" / "report.json").read_text())["per_prompt"][0]
    table = first[first.index("| decoder") :]
    assert "plain decoding" in table and "prompt lookup" in table and "eagle2: dynamic" in table
    assert "medusa1: chain" in table and "eagle3: dynamic" in table

    for method in METHODS:  # --ship copied the exports with their provenance
        shipped = recipe_set / "shipped" / method
        provenance = json.loads((shipped / "PROVENANCE.json").read_text())
        assert provenance["selfdistill"][0]["records"] == 8 and provenance["training"]["steps"] == 3
        assert provenance["synthesize"] is None
        assert set(provenance["files_sha256"]) == {
            "config.json", "model.safetensors", "draft_vocab.safetensors", "metrics.jsonl", "target_config.json"
        }  # fmt: skip
        for name, digest in provenance["files_sha256"].items():
            assert hashlib.sha256((shipped / name).read_bytes()).hexdigest() == digest

    again = run(str(recipe_set)).stdout
    assert again.count("skipped:") == 7  # target, 3 exports, 3 reports
    assert "8 records (0 new)" in again  # self-distillation and extraction run, and find nothing to do

    # a larger train.max_steps resumes training, exports again and evaluates again; --ship replaces the shipped files
    path = recipe_set / "eagle2.yaml"
    conf = yaml.safe_load(path.read_text())
    conf["train"]["max_steps"] = 4
    path.write_text(yaml.safe_dump(conf))
    shipped = recipe_set / "shipped" / "eagle2"  # a file an earlier ship wrote (listed in its provenance) goes
    (shipped / "stale.bin").write_bytes(b"from an earlier ship")
    earlier = json.loads((shipped / "PROVENANCE.json").read_text())
    earlier["files_sha256"]["stale.bin"] = hashlib.sha256(b"from an earlier ship").hexdigest()
    (shipped / "PROVENANCE.json").write_text(json.dumps(earlier))
    longer = run(str(recipe_set), "--methods", "eagle2", "--ship").stdout
    assert "skipped:" not in longer.split("train + export eagle2")[1].split("eval eagle2")[0]
    assert (out / "eagle2" / "checkpoints" / "step-000004").is_dir()
    assert "eval/report.json is complete" not in longer
    provenance = json.loads((recipe_set / "shipped" / "eagle2" / "PROVENANCE.json").read_text())
    assert provenance["training"]["steps"] == 4 and not (recipe_set / "shipped" / "eagle2" / "stale.bin").exists()

    # another selection of methods evaluates with the same settings (prompt lookup stays with the set's first recipe):
    # nothing to redo; other settings never replace a finished report, they are said and kept
    report = out / "medusa1" / "eval" / "report.json"
    before = report.read_bytes()
    alone = run(str(recipe_set), "--methods", "medusa1").stdout
    assert f"skipped: {out / 'medusa1' / 'eval'}/report.json is complete" in alone
    other = run(str(recipe_set), "--methods", "medusa1", "eval.max_new_tokens=6").stdout
    assert "kept: " in other and "was made with other settings" in other and report.read_bytes() == before
    logs = {"selfdistill-selfdistill.log", "extract-features.log", "extract-features-eagle3.log",
            "target-stats-features-eagle3.log", "eval-medusa1.log"}  # fmt: skip
    assert {p.name for p in (out / "logs").iterdir()} >= logs


@pytest.mark.slow
def test_shipped_evaluates_given_exports_without_training(recipe_set, tmp_path):
    out = tmp_path / "shipped"
    done = run(str(recipe_set), "--shipped", "--methods", "eagle2", "--out", str(out)).stdout
    assert "train + export" not in done and (out / "eagle2" / "report.json").is_file()


@pytest.mark.slow
def test_a_set_without_pipeline_yaml_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "recipes/run.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith(f"run: {tmp_path / 'pipeline.yaml'}: no such file")


def write_pipeline(root: Path, **keys) -> Path:
    recipe_file = root / "r.yaml"
    recipe_file.write_text("{}\n")
    (root / "pipeline.yaml").write_text(yaml.safe_dump({"target": "t", "recipes": {"eagle2": str(recipe_file)}} | keys))
    return root


def test_synthesis_and_several_self_distillation_jobs_become_their_commands(tmp_path):
    from recipes.run import load_pipeline, selfdistill_cmd, synthesize_cmd

    synth = {"out": "s.jsonl", "count": 64, "kinds": "k.yaml", "processes": 2, "language": "any", "top_p": 0.9}
    jobs = [{"prompts": "a.jsonl", "out": "a-out.jsonl", "limit": 8}, {"prompts": "s.jsonl", "out": "s-out.jsonl"}]
    spec = load_pipeline(write_pipeline(tmp_path, synthesize=synth, selfdistill=jobs))
    cmd = synthesize_cmd(spec["synthesize"], "t")
    assert cmd[cmd.index("-m", 3) :] == ["-m", "data.synthesize", "--target", "t", "--count", "64", "--kinds",
        "k.yaml", "--language", "any", "--out", "s.jsonl", "--seed", "0", "--top-p", "0.9"]  # fmt: skip
    assert "--num_processes" in cmd and cmd[cmd.index("--num_processes") + 1] == "2"
    second = selfdistill_cmd(spec["selfdistill"][1], "t")
    assert second[1:] == ["-m", "data.selfdistill", "--target", "t", "--prompts", "s.jsonl", "--out", "s-out.jsonl",
        "--seed", "0"]  # fmt: skip
    engine = selfdistill_cmd({"prompts": "a", "out": "o", "engine": "vllm", "engine_args": {"max_num_seqs": 8}}, "t")
    assert engine[engine.index("--engine") :] == ["--engine", "vllm", "--engine-args", '{"max_num_seqs": 8}']
    one = load_pipeline(write_pipeline(tmp_path, selfdistill=jobs[0]))  # a single job as a mapping, as before
    assert one["selfdistill"] == [jobs[0]]


def _report(tau: float, speedup: float, lookup: float | None = None) -> dict:
    return {"tokens_per_s": {"plain": 10.0, "prompt_lookup": lookup, "speculative": 10.0 * speedup},
            "speedup_vs_plain": speedup, "prompt_lookup_vs_plain": None if lookup is None else lookup / 10.0,
            "accept_len": tau, "accept_rate_by_depth": [0.8, 0.6], "tree": "dynamic d4", "lossless": True,
            "lossless_prompts": "8/8", "num_prompts": 8}  # fmt: skip


def test_the_table_gains_general_chat_columns_when_the_set_has_general_prompts(tmp_path):
    """With `general:` every method is evaluated on those prompts too (one of them with prompt lookup), and the
    table gives their τ and speedups beside the documentation ones; without it the table is as before."""
    from recipes.run import load_pipeline
    from recipes.summary import table

    reports = {"eagle3": _report(3.5, 1.8, lookup=15.0), "eagle2": _report(2.7, 1.4)}
    general = {"eagle3-general": _report(2.9, 1.5, lookup=12.0), "eagle2-general": _report(2.1, 1.1)}
    lines = table(reports | general).splitlines()
    assert lines[0].split("|")[-3:-1] == [" τ, 8 general prompts ", " vs plain (general) "]
    rows = {line.split("|")[1].strip().split(":")[0]: [c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]}
    assert rows["eagle3"][-2:] == ["2.90", "1.50×"] and rows["eagle2"][-2:] == ["2.10", "1.10×"]
    assert rows["prompt lookup (transformers)"][-1] == "1.20×" and rows["plain decoding"][-1] == "1.00×"
    assert len(table(reports).splitlines()[0].split("|")) == len(lines[0].split("|")) - 2
    spec = load_pipeline(write_pipeline(tmp_path, general={"prompts": "mt.jsonl", "max_prompts": 4}))
    assert spec["general"] == {"prompts": "mt.jsonl", "max_prompts": 4}
    with pytest.raises(SystemExit, match="general: needs prompts"):
        load_pipeline(write_pipeline(tmp_path, general={"max_prompts": 4}))


def test_a_chat_dataset_step_becomes_its_command(tmp_path):
    from recipes.run import chatsets_cmd, load_pipeline

    chatset = {"source": "sharegpt", "out": "d", "exclude": ["mt.jsonl", "other.jsonl"], "max_user_turns": 2}
    spec = load_pipeline(write_pipeline(tmp_path, chatsets=chatset))
    cmd = chatsets_cmd(spec["chatsets"][0], "t")
    assert cmd[1:] == ["-m", "data.chatsets", "sharegpt", "--out", "d", "--exclude", "mt.jsonl", "--exclude",
        "other.jsonl", "--max-user-turns", "2", "--target", "t"]  # fmt: skip
    assert "--target" not in chatsets_cmd({"source": "f.json", "out": "d", "language": "any"}, "t")


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"chatsets": {"source": "sharegpt"}}, "chatsets: needs source and out"),
        ({"chatsets": [{"source": "s", "out": "o", "turns": 2}]}, "chatsets: needs source and out, and takes the keys"),
        ({"chatsets": {"source": "s", "out": "o", "exclude": "mt.jsonl"}}, "chatsets.exclude: a list"),
        ({"synthesize": {"out": "s.jsonl"}}, "synthesize: needs out and count"),
        ({"synthesize": {"out": "s.jsonl", "count": 4, "topics": "x"}}, "synthesize: takes the keys"),
        ({"selfdistill": [{"prompts": "a"}, {"prompts": "b", "out": "o"}]}, r"selfdistill\[0\]: needs prompts and out"),
        ({"selfdistill": [{"prompts": "a", "out": "o"}, {"prompts": "b", "out": "o"}]}, "two jobs write the same out"),
        ({"selfdistill": "a.jsonl"}, "selfdistill: a mapping of settings, or a list of them"),
    ],
)
def test_bad_synthesis_and_self_distillation_settings_are_one_line(tmp_path, keys, message):
    from recipes.run import load_pipeline

    with pytest.raises(SystemExit, match=message):
        load_pipeline(write_pipeline(tmp_path, **keys))


# --------------------------------------------------------------------------------------------
# --ship replaces only what a ship (or an export) wrote


def fake_run(root: Path) -> tuple[dict, dict, Path]:
    """(pipeline spec, recipe, recipe-set directory) of a run with an export, metrics and a target config: what
    `ship` copies, without training anything."""
    from models.io import EXPORT_MARKER

    run_dir, target = root / "run", root / "target"
    (run_dir / "export").mkdir(parents=True)
    (run_dir / "export" / "config.json").write_text("{}\n")
    (run_dir / "export" / "model.safetensors").write_bytes(b"weights")
    (run_dir / "export" / EXPORT_MARKER).write_text(
        json.dumps(
            {"files": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in (run_dir / "export").iterdir()}}
        )
    )
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    target.mkdir()
    (target / "config.json").write_text("{}\n")
    spec = {"target": str(target), "recipes": {"eagle2": "r.yaml"}, "shipped": {"eagle2": str(root / "shipped")}}
    return spec, {"train": {"output_dir": str(run_dir), "batch_size": 2}}, root


def test_ship_replaces_a_previous_ship_and_refuses_anything_else(tmp_path):
    from recipes.ship import ship

    spec, conf, directory = fake_run(tmp_path)
    dest = tmp_path / "shipped"
    refusal = rf"^run: {directory / 'pipeline.yaml'}: shipped\.eagle2: {dest}"

    dest.mkdir()  # a user's directory: refused, naming it, and left as it was
    (dest / "thesis.tex").write_text("mine")
    with pytest.raises(SystemExit, match=rf"{refusal} is not a shipped drafter \(no PROVENANCE.json\)"):
        ship(spec, "eagle2", conf, directory)
    assert sorted(p.name for p in dest.iterdir()) == ["thesis.tex"] and (dest / "thesis.tex").read_text() == "mine"
    (dest / "thesis.tex").unlink()
    dest.rmdir()
    dest.write_text("mine")  # a file
    with pytest.raises(SystemExit, match=rf"{refusal} is a file"):
        ship(spec, "eagle2", conf, directory)
    assert dest.read_text() == "mine"
    dest.unlink()
    (tmp_path / "elsewhere").mkdir()
    dest.symlink_to(tmp_path / "elsewhere")  # a link
    with pytest.raises(SystemExit, match=rf"{refusal} is a symbolic link"):
        ship(spec, "eagle2", conf, directory)
    dest.unlink()

    ship(spec, "eagle2", conf, directory)  # nothing there: shipped
    listed = set(json.loads((dest / "PROVENANCE.json").read_text())["files_sha256"])
    assert listed == {"config.json", "model.safetensors", "metrics.jsonl", "target_config.json"}
    provenance = json.loads((dest / "PROVENANCE.json").read_text())
    provenance["files_sha256"]["old.bin"] = "0" * 64  # a file of an earlier ship, which this one does not write
    (dest / "PROVENANCE.json").write_text(json.dumps(provenance))
    (dest / "old.bin").write_bytes(b"earlier")
    ship(spec, "eagle2", conf, directory)  # a previous ship: replaced whole
    assert sorted(p.name for p in dest.iterdir()) == sorted(listed | {"PROVENANCE.json"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "run", "shipped", "target"]  # nothing staged

    (dest / "notes.txt").write_text("mine")  # a previous ship holding a file it did not write: refused, naming it
    with pytest.raises(SystemExit, match=rf"{refusal} holds notes.txt, which no ship wrote"):
        ship(spec, "eagle2", conf, directory)
    assert (dest / "notes.txt").read_text() == "mine" and (dest / "model.safetensors").is_file()

    shutil.rmtree(dest)  # an export (its marker lists what it wrote) holding a user's file too: refused, naming it
    shutil.copytree(tmp_path / "run" / "export", dest)
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=rf"{refusal} holds notes.txt, which no export wrote, beside an export"):
        ship(spec, "eagle2", conf, directory)
    assert (dest / "notes.txt").read_text() == "mine"
    (dest / "notes.txt").unlink()
    ship(spec, "eagle2", conf, directory)  # the export alone: replaced
    assert sorted(p.name for p in dest.iterdir()) == sorted(listed | {"PROVENANCE.json"})


@pytest.mark.slow
def test_ship_to_a_directory_it_did_not_write_is_refused_before_any_step(tmp_path):
    """`--ship` checks every shipped directory before the pipeline's first step (hours before it would copy)."""
    shipped = tmp_path / "my-files"
    shipped.mkdir()
    (shipped / "keep.txt").write_text("mine")
    write_pipeline(tmp_path, shipped={"eagle2": str(shipped)})
    done = subprocess.run(
        [sys.executable, "recipes/run.py", str(tmp_path), "--ship"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr and "===" not in done.stdout
    assert done.stderr.strip() == (
        f"run: {tmp_path / 'pipeline.yaml'}: shipped.eagle2: {shipped} is not a shipped drafter (no PROVENANCE.json) "
        "nor an export (no .specdraft-export), and --ship replaces the directory whole: it holds files it did not "
        "write; choose another path, or empty it yourself"
    )
    assert (shipped / "keep.txt").read_text() == "mine"


def test_an_alias_bomb_in_pipeline_yaml_is_refused(tmp_path):
    from recipes.run import load_pipeline

    write_pipeline(tmp_path)
    nine = lambda alias: "[" + ", ".join([alias] * 9) + "]"  # noqa: E731
    levels = ", ".join(f"&{name} {nine('*' + below)}" for below, name in zip("abcdefgh", "bcdefghi"))
    text = (tmp_path / "pipeline.yaml").read_text()
    (tmp_path / "pipeline.yaml").write_text(text + f"large_trees: {{bomb: [&a {nine('x')}, {levels}]}}\n")
    with pytest.raises(SystemExit, match=r"^run: .*pipeline.yaml: line \d+, column \d+: aliases expand"):
        load_pipeline(tmp_path)
    (tmp_path / "pipeline.yaml").write_text(text + "large_trees: [\n")
    with pytest.raises(SystemExit, match=r"pipeline.yaml: not valid YAML: line \d+"):
        load_pipeline(tmp_path)


@pytest.mark.slow
def test_a_long_step_shows_its_progress_on_the_console(tmp_path, capsys):
    from recipes.steps import follow

    script = (
        "import sys, time\n"
        "for i in range(5):\n"
        "    sys.stderr.write(f'\\rself-distill: {i}/4 [00:0{i}<00:0{4 - i}]'); sys.stderr.flush(); time.sleep(0.4)\n"
        "print('wrote 4 records')\n"
    )
    log = tmp_path / "step.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=f, stderr=subprocess.STDOUT)
        assert follow(proc, log, every=0.1, new_line_every=0.5) == 0
    shown = capsys.readouterr().out.splitlines()
    assert len(shown) >= 2 and all(line.startswith("  [00:00:0") for line in shown)  # elapsed, then the bar
    assert any("self-distill:" in line and "<00:0" in line for line in shown)  # done, and the time left
    assert "wrote 4 records" in log.read_text()  # the log keeps everything


def test_the_report_says_what_to_serve_and_when_prompt_lookup_wins():
    from recipes.summary import verdict

    runs = {"eagle3": ("runs/e3", "runs/e3/export-vllm"), "medusa1": ("runs/m1", "runs/m1/export-vllm")}
    methods = {"eagle3": "eagle3", "medusa1": "medusa1"}
    reports = {"eagle3": _report(3.1, 1.8, lookup=12.0), "medusa1": _report(2.0, 1.3)}
    said = verdict(reports, methods, "artifacts/target", runs)
    assert said.startswith("What to serve: eagle3 (1.80x plain decoding, τ 3.10; prompt lookup 1.20x).")
    assert "python -m export runs/e3 --format vllm --out runs/e3/export-vllm" in said
    assert '"method": "eagle3", "model": "runs/e3/export-vllm"' in said
    reports["eagle3"]["lossless"] = False  # a drafter whose outputs differed from plain decoding is never advised
    assert verdict(reports, methods, "artifacts/target", runs).startswith("What to serve: medusa1 (1.30x")
    slow = {"eagle3": _report(2.2, 0.9, lookup=11.0)}
    said = verdict(slow, methods, "artifacts/target", runs)
    assert said.startswith("What to serve: prompt lookup. It beats every drafter here (1.10x plain decoding against")
    assert '"method": "ngram"' in said
    # a sweep's configuration that wins is named with its tree settings
    reports = {"eagle3": _report(3.1, 1.5, lookup=12.0), "eagle3-lookup": _report(3.6, 1.7, lookup=12.0)}
    methods = {"eagle3": "eagle3", "eagle3-lookup": "eagle3"}
    settings = {"eagle3": [], "eagle3-lookup": ["eval.baselines=[plain]", "eval.lookup_tokens=10"]}
    said = verdict(reports, methods, "artifacts/target", runs, settings)
    assert said.startswith("What to serve: eagle3-lookup (1.70x") and "It won with eval.lookup_tokens=10" in said


OTHER_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] | capitalize }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}### Assistant\n{% endif %}"
)


@pytest.mark.slow
def test_a_new_set_made_for_another_target_runs_as_written(tmp_path):
    """`run.py --new` for a 5-layer Qwen2 with a chat template of its own (neither SmolLM2's depth nor its template):
    the set chooses its layers, splits the prompts, names nothing of SmolLM2, passes --check, and runs to an
    evaluated EAGLE-3.1 export (shortened by overrides), its draft vocabulary sized from the answers; without
    --check, --new writes a set and runs it in the same command."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    target = tmp_path / "target"
    tok = AutoTokenizer.from_pretrained(POCKET)
    tok.chat_template = OTHER_TEMPLATE
    config = Qwen2Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         initializer_range=0.5, tie_word_embeddings=False)  # fmt: skip
    import torch

    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(target)
    tok.save_pretrained(target)
    prompts = tmp_path / "my-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"Task {i}: add "
                       f"{i} and {2 * i}."}]}) + "\n" for i in range(12)))  # fmt: skip
    made = tmp_path / "my-set"
    out = run(str(made), "--new", "--target", str(target), "--prompt-file", str(prompts), "--check").stdout
    assert "fused [1, 2, 4]" in out and "11 prompts" in out and "no problems" in out
    recipe_text = (made / "eagle3.yaml").read_text()
    pipeline_text = (made / "pipeline.yaml").read_text()
    assert recipe_text.startswith(f"# python -m data.extract {made / 'eagle3.yaml'}")
    assert pipeline_text.startswith(f"# python recipes/run.py {made}")
    assert "smollm2" not in (recipe_text + pipeline_text).lower()
    conf = yaml.safe_load(recipe_text)
    assert conf["drafter"]["feature_layers"] == [1, 2, 4] and conf["data"]["layers"] == [1, 2, 4, -1]
    assert len((made / "prompts" / "heldout.jsonl").read_text().splitlines()) == 1
    assert len((made / "prompts" / "train.jsonl").read_text().splitlines()) == 11
    with pytest.raises(AssertionError, match="exists"):
        run(str(made), "--new", "--target", str(target), "--prompt-file", str(prompts))

    short = ["train.max_steps=3", "train.warmup_steps=0", "train.batch_size=2", "eval.max_prompts=1",
             "eval.max_new_tokens=8", "eval.kernels=reference"]  # fmt: skip
    made = tmp_path / "one-command"  # --new without --check: the set is written and run by the same command
    log = run(str(made), "--new", "--target", str(target), "--prompt-file", str(prompts), *short).stdout
    assert "eval.lookup_tokens=10" in log  # the sweep ran
    sized = yaml.safe_load((made / "eagle3.yaml").read_text())["drafter"]["draft_vocab"]
    assert f"drafter.draft_vocab: 8192 -> {sized}" in log and 4 <= sized < 8192
    report = json.loads((made / "run" / "eagle3" / "eval" / "report.json").read_text())
    assert report["num_prompts"] == 1 and report["lossless"] is True
    for name in ("eagle3-lookup", "eagle3-cost", "eagle3-lookup-cost"):  # the sweep, weighed by the closing line
        assert json.loads((made / "run" / "eagle3" / f"eval-{name}" / "report.json").read_text())["lossless"] is True
    assert "What to serve:" in log


def test_new_sets_choose_layers_for_any_depth_and_size_the_draft_vocabulary():
    import torch

    from data.vocab_counts import coverage_size
    from recipes.new import feature_layers, sizes

    assert feature_layers(30) == [2, 15, 27] and feature_layers(8) == [2, 4, 5]
    assert [feature_layers(n) for n in (1, 2, 3, 4, 5, 7)] == [[0, 1], [0, 1, 2], [0, 1, 2], [1, 2, 3], [1, 2, 4],
                                                               [1, 3, 6]]  # fmt: skip
    for n in range(1, 40):  # distinct, ascending, within 0..L
        layers = feature_layers(n)
        assert layers == sorted(set(layers)) and 0 <= layers[0] and layers[-1] <= n
    counts = torch.tensor([50, 0, 30, 15, 5])  # token ids by count: 0 (50%), 2 (30%), 3 (15%), 4 (5%)
    assert [coverage_size(counts, c) for c in (0.5, 0.8, 0.81, 0.95, 0.99, 1.0)] == [1, 2, 3, 3, 4, 4]
    config = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
              "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "dtype": "bfloat16",
              "max_position_embeddings": 8192}  # fmt: skip
    cpu = sizes(config, 6930, {"gpus": 0, "gpu_memory": 0, "host_memory": 24e9, "cpu_bf16": False})
    assert cpu["dtype"] == "float32" and cpu["max_len"] == 1024 and cpu["processes"] == 2
    assert cpu["max_steps"] == max(100, -(-2 * 6930 // cpu["batch_size"]))
    small = sizes(config, 10, {"gpus": 0, "gpu_memory": 0, "host_memory": 2e9, "cpu_bf16": True})
    assert small["dtype"] == "bfloat16" and small["batch_size"] < cpu["batch_size"] and small["max_steps"] == 100
    gpu = sizes(config, 6930, {"gpus": 8, "gpu_memory": 80e9, "host_memory": 24e9, "cpu_bf16": False})
    assert gpu["dtype"] == "bfloat16" and gpu["max_len"] == 2048 and gpu["processes"] == 8
