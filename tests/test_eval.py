"""`python -m eval` end to end on a tiny recipe, prompt rendering, report files.

TRITON_INTERPRET=1 .venv/bin/pytest tests/test_eval.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from tiny import accelerate_launch, tiny_llama

from data.extract import main as extract_main
from data.heldout import HeldoutError, read_heldout, write_heldout
from data.prepare import prepare_dataset
from data.shards import FeatureDataset
from data.vocab_counts import frequent_loss_tokens, loss_token_counts
from eval import EvalError
from eval.__main__ import main
from eval.calibration import calibration_samples, calibration_sequences, draft_vocabulary, medusa_rank_accuracy
from eval.checks import near_tie
from eval.decode import rounds_in_loop
from eval.prompts import load_prompts, prompt_token_ids
from eval.report import lossless_mark, plot, summarize, to_markdown, write_report
from methods.eagle2.model import EagleConfig, EagleDrafter
from methods.medusa1.model import MedusaConfig, MedusaHeads
from methods.medusa2.model import Medusa2Config, Medusa2Model
from models.io import FORMAT, FORMAT_VERSION, save_draft_vocab, save_native
from models.target import load_target
from schema.recipe import load_recipe

TOKENIZER = "recipes/pocket/target"
TARGET = {
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.1,
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: thread start-up dominates, and the machine's cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return load_target(random_init=TARGET, tokenizer=TOKENIZER, dtype="float32")


def _recipe(tmp_path, method: str, drafter: dict, eval_section: dict, online: bool = False) -> str:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            [
                json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Count to five."}]}),
                json.dumps(
                    {"conversations": [{"from": "human", "value": "Name a river."}, {"from": "gpt", "value": "x"}]}
                ),
                json.dumps({"prompt": "def add(a, b):\n    return"}),
            ]
        )
        + "\n"
    )
    recipe = {
        "target": {"random_init": TARGET, "tokenizer": TOKENIZER, "dtype": "float32"},
        "data": {"train_files": ["tests/fixtures/tiny-chat.jsonl"]},
        "drafter": {"method": method, **drafter},
        "train": {"output_dir": str(tmp_path / "run"), "online": online},
        "eval": {"prompts": str(prompts), "max_new_tokens": 10, "kernels": "reference", **eval_section},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.parametrize(
    "method,tree",
    [("eagle2", "dynamic"), ("medusa1", "calibrated"), ("medusa2", "chain")],
)
def test_eval_cli_end_to_end(tmp_path, target, method, tree, capsys):
    torch.manual_seed(0)
    if method == "eagle2":
        drafter = EagleDrafter(EagleConfig(), target.parts([-1]))
        section = {}
    elif method == "medusa1":
        drafter = MedusaHeads(MedusaConfig(num_heads=3), target.parts([-1]))
        section = {"num_heads": 3}
    else:  # the LoRA-merged target verifies and is the plain baseline: losslessness is against it
        section = {"num_heads": 3, "lora_r": 4, "lora_dropout": 0.0}
        drafter = Medusa2Model(Medusa2Config(**section), target.parts([-1]))
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    save_native(tmp_path / "run" / "export", drafter, target)
    eval_section = {"tree": tree, "tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 6}
    recipe = _recipe(tmp_path, method, section, eval_section, online=method == "medusa2")
    main([recipe])
    out = tmp_path / "run" / "eval"
    report = json.loads((out / "report.json").read_text())
    assert report["num_prompts"] == 3 and report["lossless"] is True and report["lossless_prompts"] == "3/3"
    assert report["drafter_settings"]["method"] == method and report["drafter_settings"].get("num_heads", 3) == 3
    assert report["accept_len"] >= 1.0 and report["rounds"] == sum(
        len(r["speculative"]["accepted"]) for r in report["per_prompt"]
    )
    assert sum(v["rounds"] for v in report["by_loop"].values()) == report["rounds"]  # every round flagged
    assert report["speedup_vs_plain"] > 0 and report["speedup_vs_prompt_lookup"] > 0
    assert all(r["prompt_lookup"]["new_tokens"] == r["plain"]["new_tokens"] for r in report["per_prompt"])
    assert (out / "report.png").stat().st_size > 1000
    assert "| method | tree | τ |" in (out / "report.md").read_text()
    assert "eval/accept_len" in capsys.readouterr().out
    assert ("LoRA (merged)" in report["target"]) == (method == "medusa2")
    if tree == "calibrated":  # no feature shards in this recipe: its data's held-out split, tokenized here
        assert report["tree_calibration"].endswith("held-out samples of the recipe's data")
        assert "Tree calibrated on " in (out / "report.md").read_text()
    else:
        assert report["tree_calibration"] is None


def test_eval_batches_decode_what_batch_one_decodes(tmp_path, target):
    """`eval.batch_size: 2` over 3 prompts (a batch of 2, then 1): greedy rows stay lossless against the batched
    plain baseline, and every prompt, greedy or sampled, decodes and accepts what a batch-1 run gives it; speeds are
    batch throughputs."""
    torch.manual_seed(0)
    save_native(tmp_path / "run" / "export", EagleDrafter(EagleConfig(), target.parts([-1])), target)
    section = {"tree": "dynamic", "tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 6, "baselines": ["plain"]}
    reports = {}
    for temperature in (0.0, 0.8):
        for batch_size in (1, 2):
            out = f"t{temperature}-b{batch_size}"
            run = {"batch_size": batch_size, "output_dir": str(tmp_path / out), "temperature": temperature}
            main([_recipe(tmp_path, "eagle2", {}, section | run)])
            reports[temperature, batch_size] = json.loads((tmp_path / out / "report.json").read_text())
        one, two = reports[temperature, 1], reports[temperature, 2]
        for a, b in zip(one["per_prompt"], two["per_prompt"]):
            assert a["speculative"]["accepted"] == b["speculative"]["accepted"] and a["output"] == b["output"]
        assert two["accept_len"] == one["accept_len"] and two["speedup_vs_plain"] > 0
    two = reports[0.0, 2]
    assert two["batch_size"] == 2 and two["lossless_prompts"] == "3/3" and two["speedup_vs_prompt_lookup"] is None
    assert [r["batch_size"] for r in two["per_prompt"]] == [2, 2, 1] and two["batches"] == {"1": 1, "2": 1}
    assert "batch size 2 (batches run: 1 of 2, 1 of 1;" in (tmp_path / "t0.0-b2" / "report.md").read_text()


def test_eval_batch_rechecks_a_differing_batched_plain_row_alone(tmp_path, target, monkeypatch):
    """If the batched plain baseline disagrees with a speculative row (a padding mask breaking a near-tie), the row is
    judged against plain decoding of its prompt alone, and the record says so."""
    import eval.run as cli

    torch.manual_seed(0)
    save_native(tmp_path / "run" / "export", EagleDrafter(EagleConfig(), target.parts([-1])), target)
    batched = cli.plain_generate_batch

    timed = []

    def off_by_one(*args, **kwargs):
        results = batched(*args, **kwargs)
        results[0].tokens[0] = (results[0].tokens[0] + 1) % TARGET["vocab_size"]  # a flipped near-tie, simulated
        del results[0].tokens[-2:]  # ... that also ended it sooner
        timed.append(len(results[0].tokens))
        return results

    monkeypatch.setattr(cli, "plain_generate_batch", off_by_one)
    section = {"tree": "dynamic", "tree_depth": 2, "tree_top_k": 2, "tree_total_tokens": 4, "baselines": ["plain"]}
    main([_recipe(tmp_path, "eagle2", {}, section | {"batch_size": 3})])
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["lossless_prompts"] == "3/3"
    assert [("lossless_baseline" in r) for r in report["per_prompt"]] == [True, False, False]
    # the plain speed stays the batch's own (its tokens over its time), not the solo run's tokens over batch time
    assert report["per_prompt"][0]["plain"]["new_tokens"] == timed[-1]  # (the first call is the warm-up)


def test_eval_two_processes_split_and_gather(tmp_path, target):
    """`accelerate launch` with 2 CPU processes (gloo): prompts are split, records gathered into one report."""
    torch.manual_seed(0)
    save_native(tmp_path / "run" / "export", EagleDrafter(EagleConfig(), target.parts([-1])), target)
    recipe = _recipe(tmp_path, "eagle2", {}, {"tree_depth": 2, "tree_top_k": 2, "tree_total_tokens": 4})
    launch = accelerate_launch("--multi_gpu", "--num_processes", "2")
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launch, "-m", "eval", recipe], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-8000:]
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["num_processes"] == 2 and [r["index"] for r in report["per_prompt"]] == [0, 1, 2]
    assert report["lossless"] is True


def test_draft_vocabulary_counts_loss_tokens_of_the_shards(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    features = tmp_path / "features"
    extract_main(["recipes/tiny/eagle2.yaml", f"data.features_dir={features}"])
    dataset = FeatureDataset(features)
    items = [dataset[i] for i in range(len(dataset))]
    loss_ids = torch.cat([item["input_ids"][item["loss_mask"] > 0] for item in items])
    all_ids = torch.cat([item["input_ids"] for item in items])
    assert len(loss_ids) < len(all_ids)  # prompts are in the shards but never counted
    counts = torch.bincount(loss_ids)
    assert frequent_loss_tokens(dataset, 10).tolist() == counts.argsort(descending=True, stable=True)[:10].tolist()
    assert len(frequent_loss_tokens(dataset, 10**6)) == int((counts > 0).sum())  # never pads with unseen tokens
    skipped = {items[0]["id"], items[-1]["id"]}  # a run's held-out samples: left out of the counts
    kept = torch.cat([item["input_ids"][item["loss_mask"] > 0] for item in items if item["id"] not in skipped])
    assert torch.equal(
        loss_token_counts(dataset, vocab_size=8192, skip_ids=skipped), torch.bincount(kept, minlength=8192)
    )

    # Medusa tree calibration reads the training run's held-out split (the shards' token ids, or the prepared
    # data without shards), never the eval prompts; the verifying target computes the hidden states
    overrides = [f"data.features_dir={features}", "data.heldout_fraction=0.25", f"train.output_dir={tmp_path}/run"]
    recipe = load_recipe("recipes/tiny/eagle2.yaml", overrides)  # a run directory without a recorded split
    tiny = load_target(**dataclasses.asdict(recipe.target))
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(num_heads=2), tiny.parts([-1])).eval()
    samples, desc = calibration_samples(recipe, tiny.tokenizer, limit=64)
    _, heldout = dataset.split(0.25, recipe.train.seed)
    assert desc == f"{len(heldout)} held-out samples of the feature shards of {features}"
    unsharded = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, features_dir=None))
    prepared, prepared_desc = calibration_samples(unsharded, tiny.tokenizer, limit=64)
    assert prepared_desc == f"{len(heldout)} held-out samples of the recipe's data"
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(samples, prepared))
    accuracy = medusa_rank_accuracy(heads, calibration_sequences(tiny, samples), top_k=3)
    hits, counts = torch.zeros(2, 3), torch.zeros(2)
    with torch.no_grad():
        for i in heldout:  # oracle: every position through every head, then keep loss-token targets
            item = dataset[i]
            hidden = tiny.hidden_states(item["input_ids"][None], layers=[-1])[:, :, 0]
            logits = heads.head_logits(hidden)[:, 0]  # (K, T, V)
            for k in (1, 2):
                for t in range(len(item["input_ids"]) - k - 1):
                    if item["loss_mask"][t + k + 1] > 0:
                        top = logits[k - 1, t].topk(3).indices
                        hits[k - 1] += (top == item["input_ids"][t + k + 1]).float()
                        counts[k - 1] += 1
    assert counts.min() > 0
    torch.testing.assert_close(accuracy, hits / counts[:, None])


def test_draft_vocabulary_prefers_the_exports_own_and_never_shrinks_quietly(tmp_path, monkeypatch, capsys):
    """An export ships the vocabulary it trained with; asking for more than it holds uses all of it with a line
    when the export itself asked for that many (its data has no more tokens), else counts the shards (without the
    run's held-out samples), and refuses more than they hold."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    features = tmp_path / "features"
    extract_main(["recipes/tiny/eagle2.yaml", f"data.features_dir={features}"])
    available = len(frequent_loss_tokens(FeatureDataset(features), 10**6))
    run = tmp_path / "run"  # no heldout.json yet: every sample counts
    recipe = load_recipe("recipes/tiny/eagle2.yaml", [f"data.features_dir={features}", f"train.output_dir={run}"])

    def export(asked: int, vocab: torch.Tensor) -> str:
        out = tmp_path / f"export-{asked}-{len(vocab)}"
        out.mkdir(exist_ok=True)
        config = {"format": FORMAT, "format_version": FORMAT_VERSION, "method": "eagle2", "drafter": {}, "target": {}}
        config |= {"stored_layers": [-1], "recipe": {"eval": {"draft_vocab": asked}, "train": {"loss_vocab": 0}}}
        (out / "config.json").write_text(json.dumps(config))
        save_draft_vocab(out, vocab)
        return str(out)

    shipped = frequent_loss_tokens(FeatureDataset(features), available)
    assert torch.equal(draft_vocabulary(recipe, export(available + 50, shipped), 8), shipped[:8])
    assert torch.equal(draft_vocabulary(recipe, export(available + 50, shipped), available + 50), shipped)
    assert f"{available + 50} asked, {available} available" in capsys.readouterr().out
    small = export(4, shipped[:4])  # an export of a smaller vocabulary: the shards decide, and hold no more
    assert torch.equal(draft_vocabulary(recipe, small, available), shipped)
    with pytest.raises(EvalError, match=f"eval.draft_vocab: {available + 1} asked, {available} available"):
        draft_vocabulary(recipe, small, available + 1)
    heldout = FeatureDataset(features).sample_ids[:3]  # the run recorded a split: its held-out samples do not count
    write_heldout(run, heldout)
    assert torch.equal(draft_vocabulary(recipe, small, 8), frequent_loss_tokens(FeatureDataset(features), 8, heldout))


def test_calibration_reads_the_held_out_split_the_run_recorded(tmp_path, monkeypatch, capsys):
    """A run directory with `heldout.json` gives calibration exactly those samples, whatever the recipe's fraction and
    seed now say; without one the split is re-created from the recipe, with a log line; a recorded split of other data
    is refused."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    run = tmp_path / "run"
    recipe = load_recipe("recipes/tiny/eagle2.yaml", ["data.features_dir=null", f"train.output_dir={run}"])
    tiny = load_target(**dataclasses.asdict(recipe.target))
    ids = [s["id"] for s in prepare_dataset(recipe.data, tiny.tokenizer).samples]
    chosen = sorted(ids)[2:5]
    assert read_heldout(run) is None
    _, desc = calibration_samples(recipe, tiny.tokenizer, limit=64)
    assert desc.endswith("held-out samples of the recipe's data") and "re-creating" in capsys.readouterr().out

    assert write_heldout(run, chosen) == run / "heldout.json" and read_heldout(run) == chosen
    samples, desc = calibration_samples(recipe, tiny.tokenizer, limit=64)
    assert desc == "3 held-out samples of the recipe's data" and "re-creating" not in capsys.readouterr().out
    prepared = {s["id"]: s for s in prepare_dataset(recipe.data, tiny.tokenizer).samples}
    assert [ids.tolist() for ids, _ in samples] == [prepared[i]["input_ids"] for i in chosen]

    write_heldout(run, [10**9])
    with pytest.raises(EvalError, match="none of its 1 held-out samples is in the recipe's data"):
        calibration_samples(recipe, tiny.tokenizer, limit=64)
    (run / "heldout.json").write_text("{not json\n")
    with pytest.raises(HeldoutError, match="heldout.json: not a held-out split written by training"):
        read_heldout(run)


def test_cli_runs_triton_kernels_under_the_interpreter_without_a_gpu_and_says_so(tmp_path, target, capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only path (interpreter turned on by the CLI); with a GPU the kernels run natively")
    torch.manual_seed(0)
    save_native(tmp_path / "run" / "export", EagleDrafter(EagleConfig(), target.parts([-1])), target)
    section = {"tree": "dynamic", "tree_depth": 2, "tree_top_k": 2, "tree_total_tokens": 4, "kernels": "triton"}
    main([_recipe(tmp_path, "eagle2", {}, section | {"baselines": ["plain"], "max_prompts": 1})])
    assert "the Triton kernels run under the Triton interpreter" in capsys.readouterr().out
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["kernels_backend"] == "Triton interpreter (no GPU)" and report["lossless"] is True
    assert "kernels: Triton interpreter (no GPU)" in (tmp_path / "run" / "eval" / "report.md").read_text()


@pytest.mark.parametrize("path", ["recipes/pocket/eagle2.yaml", "recipes/pocket/medusa1.yaml"])
def test_pocket_recipes_load(path):
    recipe = load_recipe(path)
    assert recipe.eval.prompts == "recipes/pocket/prompts/heldout.jsonl" and recipe.data.layers == [-1]
    assert recipe.eval.tree_depth <= 3  # small trees on a CPU: verification is not free there
    assert recipe.eval.tree == "chain" or recipe.eval.tree_total_tokens <= 10


def test_prompt_rendering(target):
    tok = target.tokenizer
    chat = prompt_token_ids(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, tok, "x"
    )
    text = tok.decode(chat)
    assert text.endswith("<|assistant|>\n") and "yo" not in text  # generation prompt, answer dropped
    plain = prompt_token_ids({"prompt": "hello"}, tok, "x")
    assert plain[0] == tok.bos_token_id and tok.decode(plain[1:]) == "hello"
    with pytest.raises(EvalError, match="f.jsonl:3"):
        prompt_token_ids({"text": "?"}, tok, "f.jsonl:3")


def test_bad_prompts_file(tmp_path, target):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(EvalError, match="p.jsonl:2"):
        load_prompts(str(bad), target.tokenizer, None)
    assert len(load_prompts(str(bad), target.tokenizer, 1)) == 1
    for line, what in (
        ('["a list"]', "a prompt record must be a JSON object"),
        ('{"messages": ["hi"]}', "a turn must be"),
    ):
        bad.write_text('{"prompt": "a"}\n' + line + "\n")
        with pytest.raises(EvalError, match=f"p.jsonl:2: {what}"):
            load_prompts(str(bad), target.tokenizer, None)


def test_counts_that_select_data_take_at_most_what_the_data_holds(tmp_path, target):
    """eval.max_prompts and train.eval_batches are not sizes to bound: a huge value selects every prompt or
    held-out sample, allocating nothing for the count itself."""
    from train.loop import evaluated_heldout

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    assert len(load_prompts(str(prompts), target.tokenizer, 10**12)) == 3
    assert evaluated_heldout([4, 1, 7], 10**12 * 4096, seed=0) == [4, 1, 7]
    assert len(evaluated_heldout(list(range(100)), 8, seed=0)) == 8


def _record(i, accepted, extendable, lossless, spec_tokens=10, plain_tokens=10):
    spec = {"accepted": accepted, "extendable": extendable, "new_tokens": spec_tokens, "wall_s": 1.0,
            "target_forwards": 4}  # fmt: skip
    plain = {"new_tokens": plain_tokens, "wall_s": 2.0}
    return {"index": i, "speculative": spec, "plain": plain, "prompt_lookup": {"new_tokens": 10, "wall_s": 1.5},
            "lossless": lossless}  # fmt: skip


REPORT_META = {k: "x" for k in ("method", "tree", "target", "prompts", "acceptance", "kernels", "device")} | {
    "max_new_tokens": 10,
    "temperature": 0.0,
}


def test_summary_pools_rounds():
    s = summarize([_record(1, [3, 1], [True, True], True), _record(0, [0], [True], False)], REPORT_META)
    assert s["accept_len"] == pytest.approx((4 + 2 + 1) / 3)
    assert s["speedup_vs_plain"] == pytest.approx(2.0) and s["speedup_vs_prompt_lookup"] == pytest.approx(1.5)
    assert s["lossless"] is False and s["lossless_prompts"] == "1/2"
    assert s["forwards_per_token"] == pytest.approx(8 / 20)
    assert [r["index"] for r in s["per_prompt"]] == [0, 1]
    assert "✗" in to_markdown(s)


def test_report_marks_typical_acceptance_lossy():
    """Typical acceptance accepts by a threshold, not by the target's distribution: lossy, not n/a as for rejection
    sampling (lossless by construction) and not ✓ / ✗ as for greedy runs checked against plain decoding."""
    sampled = REPORT_META | {"temperature": 0.7}
    for acceptance, mark in (("typical", "lossy (typical acceptance)"), ("exact", "n/a")):
        s = summarize([_record(0, [1], [True], None)], sampled | {"acceptance": acceptance})
        assert lossless_mark(s) == mark
        assert f"| {mark} |" in to_markdown(s)
    assert lossless_mark(summarize([_record(0, [1], [True], True)], REPORT_META | {"acceptance": "exact"})) == "✓"


def test_report_breaks_tau_down_by_prompt_group():
    """MT-bench categories (or the prompt sets' kinds): τ and speedup per group, in report.json and report.md."""
    records = [_record(0, [3, 1], [True, True], True), _record(1, [0], [True], True), _record(2, [2], [True], True)]
    for record, group in zip(records, ["coding", "writing", "coding"]):
        record["group"] = group
    s = summarize(records, REPORT_META)
    assert s["by_group"]["coding"]["accept_len"] == pytest.approx((4 + 2 + 3) / 3)
    assert s["by_group"]["writing"]["accept_len"] == 1.0 and s["by_group"]["writing"]["prompts"] == 1
    assert "| coding | 2 | 3.00 |" in to_markdown(s)
    # every record: 10 tokens in 1 s speculative, 2 s plain, 1.5 s prompt lookup
    assert s["by_group"]["coding"]["speedup_vs_plain"] == pytest.approx(2.0)
    assert s["by_group"]["coding"]["speedup_vs_prompt_lookup"] == pytest.approx(1.5)
    assert "| 2.00× | 1.50× |" in to_markdown(s)
    assert s["time_per_round"] is None  # these records carry no target / draft split
    assert summarize([_record(0, [1], [True], True)], REPORT_META)["by_group"] == {}


def test_report_splits_a_rounds_time():
    records = [_record(0, [3, 1], [True, True], True)]
    records[0]["speculative"] |= {"target_s": 0.6, "draft_s": 0.2}  # wall 1.0 s over 2 rounds
    t = summarize(records, REPORT_META)["time_per_round"]
    assert t == pytest.approx({"target_s": 0.3, "draft_s": 0.1, "loop_s": 0.1, "plain_token_s": 0.2})
    assert "## Time per round (ms)" in to_markdown(summarize(records, REPORT_META))


def test_report_pools_rounds_by_tree_size_and_plots_them(tmp_path):
    """Cost-aware trees change size per round: τ and tokens per second per tree size, in report.json, report.md and a
    third plot."""
    records = [_record(0, [3, 1, 0], [True] * 3, True), _record(1, [2], [True], True)]
    records[0]["speculative"] |= {"tree_nodes": [8, 4, 4], "round_s": [0.5, 0.25, 0.25]}
    records[1]["speculative"] |= {"tree_nodes": [8], "round_s": [0.5]}
    s = summarize(records, REPORT_META)
    assert s["by_tree_size"] == {
        "4": {"rounds": 2, "accept_len": 1.5, "tokens_per_s": 6.0},
        "8": {"rounds": 2, "accept_len": 3.5, "tokens_per_s": 7.0},
    }
    assert "| 8 | 2 | 3.50 | 7.0 |" in to_markdown(s)
    plot(s, tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 0
    records[1]["speculative"]["tree_nodes"] = [4]
    assert "τ by tree size" not in to_markdown(summarize(records[1:], REPORT_META))  # one size: no table


def test_rounds_inside_a_loop_of_the_output_are_flagged_and_pooled():
    """A round starts inside a loop when the output's last 8 tokens before it occurred earlier in the output; the
    report pools those rounds and the others, and says so in report.md (records without the flags: no table)."""
    fresh, loop = list(range(100, 110)), [1, 2, 3]
    tokens = fresh + loop * 6  # 28 tokens: the loop's 8-grams repeat from its fourth turn on
    accepted = [4, 4, 3, 4, 4, 2, 0]  # rounds start at 0, 5, 10, 14, 19, 24, 27 (emitting 5, 5, 4, 5, 5, 3, 1 tokens)
    # the 8 tokens before 19 (tokens 11..18) occur there first: no; those before 24 and 27 ended earlier (at 18, 21)
    assert rounds_in_loop(tokens, accepted) == [False, False, False, False, False, True, True]
    assert rounds_in_loop(loop * 2, [5]) == [False]  # the first round never is
    records = [_record(0, [3, 1, 0], [True] * 3, True), _record(1, [2], [True], True)]
    records[0]["speculative"]["in_loop"] = [False, True, True]
    records[1]["speculative"]["in_loop"] = [False]
    s = summarize(records, REPORT_META)
    assert s["by_loop"] == {
        "in_loop": {"rounds": 2, "share": 0.5, "accept_len": 1.5},
        "elsewhere": {"rounds": 2, "share": 0.5, "accept_len": 3.5},
    }
    assert "| elsewhere | 2 | 0.50 | 3.50 |" in to_markdown(s)
    del records[1]["speculative"]["in_loop"]
    assert summarize(records, REPORT_META)["by_loop"] is None
    assert "inside loops" not in to_markdown(summarize(records, REPORT_META))


def test_a_batch_round_is_timed_once_and_its_tokens_pooled():
    """Two prompts decoded as one batch: each row holds half the batch's times (its share) and the batch's round
    times. Seconds per round divide the batch's time by its rounds (3: the longer row's), not by both rows' (4) and
    not per row; tokens per second in the rounds of a tree size are both rows' tokens over the batch's one time."""
    records = [_record(0, [3, 1, 0], [True] * 3, True), _record(1, [2], [True], True)]
    for r in records:
        r |= {"batch_size": 2, "batch": 0}
        r["speculative"] |= {"wall_s": 0.5, "target_s": 0.35, "draft_s": 0.1}  # shares of 1.0, 0.7, 0.2
    records[0]["speculative"] |= {"tree_nodes": [8, 4, 4], "round_s": [0.5, 0.25, 0.25]}
    records[1]["speculative"] |= {"tree_nodes": [8], "round_s": [0.5]}
    s = summarize(records, REPORT_META)
    assert s["time_per_round"] == pytest.approx({"target_s": 0.7 / 3, "draft_s": 0.2 / 3, "loop_s": 0.1 / 3})
    assert s["by_tree_size"] == {
        "4": {"rounds": 2, "accept_len": 1.5, "tokens_per_s": 6.0},
        "8": {"rounds": 2, "accept_len": 3.5, "tokens_per_s": 14.0},  # 7 tokens of both rows in one 0.5 s round
    }


def test_prompt_records_carry_their_group(tmp_path, target):
    path = tmp_path / "p.jsonl"
    path.write_text('{"category": "math", "messages": [{"role": "user", "content": "1+1?"}]}\n{"prompt": "x"}\n')
    assert [p["group"] for p in load_prompts(str(path), target.tokenizer, None)] == ["math", None]


def test_report_speedups_are_token_rates_and_plain_is_optional(tmp_path):
    """Per-prompt speedups compare tokens/s like the headline (sampled runs differ in length); without the plain
    baseline the report still writes every file, with "–" where plain figures would be."""
    s = summarize([_record(0, [1], [True], None, spec_tokens=4, plain_tokens=10)], REPORT_META)
    assert s["speedup_vs_plain"] == pytest.approx((4 / 1.0) / (10 / 2.0))
    assert "| 0.80× |" in to_markdown(s)  # not the wall-time ratio 2.00×
    records = [_record(0, [2, 0], [True, True], None)]
    del records[0]["plain"]
    s = summarize(records, REPORT_META)
    assert s["speedup_vs_plain"] is None and s["lossless"] is None
    out = write_report(s, tmp_path / "eval")
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "report.png"}
    assert "| – |" in (out / "report.md").read_text()


def test_device_map_target_evaluates_losslessly(tmp_path):
    """`target.device_map` loads through from_pretrained's placement (here all on the CPU) and decodes as usual."""
    torch.manual_seed(0)
    pocket = load_target(path=TOKENIZER, dtype="float32", device_map="cpu")
    save_native(tmp_path / "run" / "export", MedusaHeads(MedusaConfig(num_heads=2), pocket.parts([-1])), pocket)
    recipe = yaml.safe_load(Path(_recipe(tmp_path, "medusa1", {"num_heads": 2}, {"tree": "chain", "tree_depth": 2}))
        .read_text())  # fmt: skip
    recipe["target"] = {"path": TOKENIZER, "dtype": "float32", "device_map": "cpu"}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    main([str(tmp_path / "recipe.yaml")])
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["lossless"] is True and report["device"] == "cpu"


def test_near_tie_judges_a_differing_greedy_token_by_the_float32_target():
    """Two tokens with identical lm_head rows tie exactly (float32 judge); the target's own cache-free argmax is a
    tie too (own-forward judge); a token far below the best logit that the target does not pick is a mismatch."""
    model = tiny_llama(seed=3, tie_word_embeddings=False).to(torch.bfloat16)
    prefix = [5, 17, 42, 9]
    with torch.no_grad():
        logits = model.float()(torch.tensor([prefix])).logits[0, -1]
        model.to(torch.bfloat16)
        best, second, worst = logits.argsort(descending=True)[[0, 1, -1]].tolist()
        model.lm_head.weight[second] = model.lm_head.weight[best]  # the target can't tell them apart
        own = int(model(torch.tensor([prefix])).logits[0, -1].argmax())
    tie = near_tie(model, prefix, second, best, margin=0.25)
    assert tie["tie"] and tie["judge"] == "float32" and tie["margin"] == 0.0
    assert near_tie(model, prefix, own, worst, margin=0.25)["judge"] == "own_forward"  # worst is far, own is chosen
    mismatch = near_tie(model, prefix, worst, own, margin=0.25)
    assert not mismatch["tie"] and mismatch["judge"] is None and mismatch["margin"] > 0.25


def test_the_lossless_check_goes_on_past_a_near_tie(monkeypatch):
    """After a near-tie the speculative output continues from its own token: the rest is compared with plain greedy
    decoding continued from there, so a real mismatch later in the output still fails the prompt."""
    from eval import run as eval_run
    from eval.baselines import plain_generate
    from eval.decode import DecodeSettings
    from schema.evaluation import EvalConfig

    config = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "initializer_range": 0.2, "tie_word_embeddings": False}  # fmt: skip
    target = load_target(random_init=config, dtype="float32", seed=0)
    prompt, settings = [5, 17, 3, 42, 8], DecodeSettings(max_new_tokens=16)

    def greedy(ids: list[int], n: int) -> list[int]:
        return plain_generate(target.model, torch.tensor([ids]), dataclasses.replace(settings, max_new_tokens=n)).tokens

    plain = greedy(prompt, 16)
    other = (plain[3] + 1) % 96  # taken at position 3, where the (patched) judge calls it a tie
    spec = plain[:3] + [other] + greedy(prompt + plain[:3] + [other], 12)
    judged = []

    def judge(model, prefix, a, b, margin):
        judged.append(len(prefix) - len(prompt))
        return {"tie": len(prefix) - len(prompt) == 3, "judge": None, "tokens": [a, b], "margin": 0.0}

    monkeypatch.setattr(eval_run, "near_tie", judge)
    wrong_later = spec[:12] + [(spec[12] + 1) % 96] + spec[13:]  # a real mismatch after the tie
    for output, lossless, positions in ((spec, True, [3]), (wrong_later, False, [3, 12])):
        record = {"index": 0}
        eval_run._compare_plain(record, output, plain, settings)
        judged.clear()
        eval_run._judge_mismatch(record, target, prompt, output, plain, EvalConfig(), settings)
        assert record["lossless"] is lossless and judged == positions
        assert record["near_tie"]["position"] == 3 and len(record["later_ties"]) == len(positions) - 1
        if not lossless:
            assert record["first_mismatch"] == 12
        record |= {"speculative": {"accepted": [1], "extendable": [True], "new_tokens": 16, "wall_s": 1.0,
                                   "target_forwards": 2}, "plain": {"new_tokens": 16, "wall_s": 1.0}}  # fmt: skip
        # a prompt that fails after a near-tie is a failure, not a near-tie
        want = "1/1 (1 at a near-tie)" if lossless else "0/1"
        assert summarize([record], REPORT_META)["lossless_prompts"] == want


def test_the_runs_own_export_must_be_of_its_newest_checkpoint(tmp_path, monkeypatch):
    """A run that trained on after its export: evaluating `<output_dir>/export` by default would measure the older
    drafter under the run's name, so it is refused; named with eval.drafter it is taken as it is."""
    from eval.run import run as eval_run
    from export.write import export
    from train.loop import train

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    path = _recipe(tmp_path, "eagle2", {}, {"max_prompts": 1, "max_new_tokens": 2, "baselines": []}, online=True)
    quick = ["train.batch_size=2", "train.eval_every=0", "logging.tracker=none"]
    train(load_recipe(path, [*quick, "train.max_steps=2"]))
    out = export(tmp_path / "run")
    assert json.loads((out / "config.json").read_text())["trained_steps"] == 2
    train(load_recipe(path, [*quick, "train.max_steps=4", "train.resume=auto"]))
    with pytest.raises(EvalError, match=r"export: exported at step 2, but .*run has trained on to step 4: re-export"):
        eval_run(load_recipe(path))
    summary = eval_run(load_recipe(path, [f"eval.drafter={out}"]))  # named: evaluated as it is
    assert summary["num_prompts"] == 1
    export(tmp_path / "run")  # re-exported: the default pick is current again
    assert eval_run(load_recipe(path, ["eval.output_dir=" + str(tmp_path / "again")]))["num_prompts"] == 1


def _conversations_file(tmp_path) -> Path:
    """Earlier conversation for `eval.context_lengths`: chat records (one with a system turn, one unanswered) and a
    plain prompt / completion record."""
    path = tmp_path / "context.jsonl"
    records = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Topic {i}?"},
                      {"role": "assistant", "content": f"An answer about topic {i}. " * 6}]}
        for i in range(6)
    ] + [
        {"messages": [{"role": "user", "content": "never answered"}]},
        {"prompt": "A plain question?", "completion": "A plain answer. " * 5},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prompts_follow_earlier_conversation_up_to_each_length(tmp_path, target):
    """Each chat prompt once per length: whole conversations from the source (system turns dropped, unanswered ones
    skipped) precede it, as many as fit; 0 is the prompt alone; the prompt's own ids end every input."""
    from eval.prompts import load_conversations

    conversations = load_conversations(str(_conversations_file(tmp_path)))
    assert len(conversations) == 7 and all(c[0]["role"] == "user" for c in conversations)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Count to five."}]}) + "\n")
    alone = load_prompts(str(prompts), target.tokenizer, None)[0]["input_ids"]
    out = load_prompts(str(prompts), target.tokenizer, None, [0, 80, 200, 10_000], conversations)
    assert [p["id"] for p in out] == ["a@0", "a@80", "a@200", "a@10000"] and [p["context"] for p in out] == [
        0,
        80,
        200,
        10000,
    ]
    assert out[0]["input_ids"] == alone
    lengths = [len(p["input_ids"]) for p in out]
    assert lengths[0] < lengths[1] <= 80 < lengths[2] <= 200 < lengths[3]
    tail = target.tokenizer.apply_chat_template([{"role": "user", "content": "Count to five."}], tokenize=False,
                                                add_generation_prompt=True)  # fmt: skip
    for p in out[1:]:
        text = target.tokenizer.decode(p["input_ids"])
        assert text.endswith(tail.removeprefix(target.tokenizer.bos_token or "")) and "Topic" in text
        assert "never answered" not in text and "Be brief." not in text
    everything = target.tokenizer.decode(out[3]["input_ids"])  # room for all: each conversation once
    assert all(everything.count(f"Topic {i}?") == 1 for i in range(6)) and "A plain question?" in everything


def test_eval_reports_tau_by_context_length(tmp_path, target):
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig(), target.parts([-1]))
    save_native(tmp_path / "run" / "export", drafter, target)
    section = {"tree": "dynamic", "tree_depth": 2, "tree_top_k": 2, "tree_total_tokens": 4, "max_prompts": 2,
               "context_lengths": [0, 120], "context_source": str(_conversations_file(tmp_path)),
               "draft_window": 64}  # fmt: skip
    main([_recipe(tmp_path, "eagle2", {}, section)])
    out = tmp_path / "run" / "eval"
    report = json.loads((out / "report.json").read_text())
    assert report["num_prompts"] == 4 and report["lossless"] is True
    assert [r["context"] for r in report["per_prompt"]] == [0, 0, 120, 120]
    by = report["by_context"]
    assert set(by) == {"0", "120"} and by["0"]["prompt_tokens"] < by["120"]["prompt_tokens"] <= 120
    rows = [r for r in report["per_prompt"] if r["context"] == 120]
    assert by["120"]["rounds"] == sum(len(r["speculative"]["accepted"]) for r in rows)
    assert "## τ by context length" in (out / "report.md").read_text()
    assert report["context_source"].endswith("context.jsonl")
    assert report["draft_window"] == 64 and report["tree"].endswith("window 64")


def test_the_draft_window_is_the_exports_training_length_unless_set():
    from eval.calibration import draft_window
    from schema.evaluation import EvalConfig

    config = {"recipe": {"data": {"max_len": 384}}}
    assert draft_window(EvalConfig(), config) == 384
    assert draft_window(EvalConfig(draft_window=128), config) == 128
    assert draft_window(EvalConfig(draft_window=0), config) is None  # the whole context
    assert draft_window(EvalConfig(), {}) is None  # an import records no training length


@pytest.mark.parametrize(
    "section, message",
    [
        ({"context_lengths": [0, 512]}, "eval.context_source: is required"),
        ({"context_lengths": [512, 512], "context_source": "x"}, "eval.context_lengths: lists a length twice"),
        ({"context_lengths": [-1], "context_source": "x"}, "eval.context_lengths: must be token counts >= 0"),
        ({"draft_window": -2}, r"eval.draft_window: must be >= 1 \(positions\), 0"),
    ],
)
def test_bad_context_settings_are_named(tmp_path, section, message):
    from schema.recipe import RecipeError

    with pytest.raises(RecipeError, match=message):
        load_recipe(_recipe(tmp_path, "eagle2", {}, section))


def test_context_beyond_the_targets_positions_is_refused_before_decoding(tmp_path, target):
    torch.manual_seed(0)
    save_native(tmp_path / "run" / "export", EagleDrafter(EagleConfig(), target.parts([-1])), target)
    long = [{"role": "user", "content": "word " * 3000}, {"role": "assistant", "content": "ok"}]
    (tmp_path / "long.jsonl").write_text(json.dumps({"messages": long}) + "\n")
    section = {"context_lengths": [5000], "context_source": str(tmp_path / "long.jsonl"), "max_prompts": 1}
    with pytest.raises(EvalError, match=r"eval.context_lengths: .* beyond the target's max_position_embeddings"):
        from eval.run import run

        run(load_recipe(_recipe(tmp_path, "eagle2", {}, section)))


def test_a_second_evaluation_into_the_same_output_dir_is_refused(tmp_path, target):
    """While another evaluation writes eval.output_dir (here: this test holds its lock), `python -m eval` into it
    stops with one line naming the directory and the holder, before loading anything; once free, it evaluates, and
    no lock file stays behind."""
    from rundir.lock import LOCK_FILE, acquire, release

    torch.manual_seed(0)
    save_native(tmp_path / "run" / "export", EagleDrafter(EagleConfig(), target.parts([-1])), target)
    recipe = _recipe(tmp_path, "eagle2", {}, {"tree": "chain", "tree_depth": 2, "baselines": [], "max_prompts": 1})
    out = tmp_path / "run" / "eval"
    held = acquire(out, "evaluation")
    try:
        with pytest.raises(SystemExit) as refused:
            main([recipe])
        message = str(refused.value)
        assert message.startswith(f"error: {recipe}: eval.output_dir: {out}: another evaluation is writing there")
        assert f"(pid {os.getpid()}:" in message and "\n" not in message
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written beside the holder's lock
    finally:
        release(held)
    main([recipe])
    assert (out / "report.json").is_file() and not (out / LOCK_FILE).exists()


@pytest.mark.parametrize("tree", ["dynamic", "cost"])
def test_eval_with_prompt_lookup_in_the_tree_is_lossless_and_reports_it(tmp_path, target, tree):
    torch.manual_seed(0)
    save_native(tmp_path / "run" / "export", EagleDrafter(EagleConfig(), target.parts([-1])), target)
    section = {"tree": tree, "tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 8, "lookup_tokens": 4}
    main([_recipe(tmp_path, "eagle2", {}, {**section, "baselines": ["plain"]})])
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["lossless"] is True and report["lossless_prompts"] == "3/3"
    assert report["tree"].endswith(", + prompt lookup 4 (n-gram <= 3)")
    lookup = report["lookup"]
    assert lookup["tokens"] == 4 and lookup["ngram"] == 3 and lookup["tried"] >= lookup["accepted"] >= 0
    assert "Prompt lookup in the tree (4 tokens" in (tmp_path / "run" / "eval" / "report.md").read_text()


@pytest.mark.parametrize(
    "key,value,message", [("lookup_tokens", -1, "must be >= 0"), ("lookup_ngram", 0, "must be >= 1")]
)
def test_prompt_lookup_settings_are_checked(tmp_path, key, value, message):
    from schema.recipe import RecipeError

    path = _recipe(tmp_path, "eagle2", {}, {})
    with pytest.raises(RecipeError, match=f"eval.{key}: {message}"):
        load_recipe(path, [f"eval.{key}={value}"])
