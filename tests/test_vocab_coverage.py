"""`python -m data.vocab_counts`: how much of the answers a draft vocabulary of each size covers, chosen as training
chooses it, on the training split, the held-out split and the target's outputs in evaluation reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data.extract import main as extract_main
from data.prepare import prepare_dataset
from data.shards import FeatureMismatchError, split_by_id
from data.vocab_counts import coverage_size, frequent_loss_tokens, main, most_frequent
from models.target import load_tokenizer
from schema.recipe import load_recipe

RECIPE = "recipes/tiny/eagle3.yaml"


def rows(printed: str) -> dict[int, list[str]]:
    """The table's rows by size: the cells after the size."""
    out = {}
    for line in printed.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0].replace(",", "").isdigit():
            out[int(cells[0].replace(",", ""))] = cells[1:]
    return out


def expected(recipe, tokenizer, size: int, outputs: list[str]) -> list[str]:
    """The coverages computed here from the prepared samples: training split, held-out split, outputs."""
    samples = prepare_dataset(recipe.data, tokenizer).samples
    train, held = split_by_id([s["id"] for s in samples], recipe.data.heldout_fraction, recipe.train.seed)

    def counts(idx):
        ids = torch.cat([torch.as_tensor(samples[i]["input_ids"])[torch.as_tensor(samples[i]["loss_mask"]) > 0]
                         for i in idx])  # fmt: skip
        return torch.bincount(ids, minlength=len(tokenizer))

    train_counts = counts(train)
    vocab = set(most_frequent(train_counts, size).tolist())
    out_ids = [t for text in outputs for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    shares = []
    for c in (train_counts, counts(held)):
        shares.append(sum(int(c[t]) for t in vocab) / int(c.sum()))
    shares.append(sum(t in vocab for t in out_ids) / len(out_ids))
    return [f"{share:.2%}" for share in shares]


def test_coverage_of_each_size_from_tokens_and_from_features_alike(tmp_path, monkeypatch, capsys):
    """Each row is the coverage of the `size` most frequent training loss tokens, computed here from the prepared
    samples: on the training split, the held-out split and a report's outputs; a feature set of the same data
    gives the same table. The sizes: the recipe's, 95 / 98 / 99 / 99.5% of the training answers, and --sizes."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    outputs = ["How do I list the files in a directory?", "Use ls -la to see hidden files too."]
    report = tmp_path / "run" / "eval-docs"
    report.mkdir(parents=True)
    (report / "report.json").write_text(json.dumps({"per_prompt": [{"output": text} for text in outputs]}))
    overrides = [f"data.features_dir={tmp_path}/features"]
    recipe = load_recipe(RECIPE, overrides)
    tokenizer = load_tokenizer(recipe.target.path, recipe.target.tokenizer, recipe.target.trust_remote_code)

    main([RECIPE, *overrides, "--sizes", "40", "100000", "--reports", str(report)])  # no features: the tokenized data
    from_tokens = capsys.readouterr().out
    table = rows(from_tokens)
    assert table[100000][0].startswith("more than the ") and table[100000][1] == "100.00%"
    assert "| draft tokens | sized by | training answers | held-out answers | outputs: run/eval-docs |" in from_tokens
    assert table[128][0] == "the recipe's" and table[40][0] == ""
    for size in (40, 128):
        assert table[size][1:] == expected(recipe, tokenizer, size, outputs), size
    samples = prepare_dataset(recipe.data, tokenizer).samples
    train, _ = split_by_id([s["id"] for s in samples], recipe.data.heldout_fraction, recipe.train.seed)
    ids = torch.cat([torch.as_tensor(samples[i]["input_ids"])[torch.as_tensor(samples[i]["loss_mask"]) > 0]
                     for i in train])  # fmt: skip
    for share in (0.95, 0.99):
        size = coverage_size(torch.bincount(ids), share)
        assert table[size][0] == f"{share:.1%} of the training answers"
        assert float(table[size][1].rstrip("%")) >= 100 * share

    extract_main([RECIPE, *overrides])
    capsys.readouterr()
    main([RECIPE, *overrides, "--sizes", "40", "100000", "--reports", str(report)])
    from_features = capsys.readouterr().out
    assert from_features.splitlines()[0] == f"{tmp_path}/features: " + from_tokens.splitlines()[0].split(": ", 1)[1]
    assert from_features.splitlines()[1:] == from_tokens.splitlines()[1:]
    with pytest.raises(FeatureMismatchError, match="max_len"):  # features training would refuse: refused here too
        main([RECIPE, *overrides, "data.max_len=64"])


def test_train_first_records_counts_as_training_does(tmp_path, monkeypatch, capsys):
    """With train.first_records the vocabulary is the one training takes (`frequent_loss_tokens` over its training
    samples: the split's, less the records past the first N); the held-out split is unchanged."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    overrides = [f"data.features_dir={tmp_path}/none", "train.first_records=40"]
    recipe = load_recipe(RECIPE, overrides)
    tokenizer = load_tokenizer(recipe.target.path, recipe.target.tokenizer, recipe.target.trust_remote_code)
    samples = prepare_dataset(recipe.data, tokenizer).samples
    train, held = split_by_id([s["id"] for s in samples], recipe.data.heldout_fraction, recipe.train.seed)
    trained = [i for i in train if int(samples[i]["id"]) < 40]
    skip = {s["id"] for i, s in enumerate(samples) if i not in trained}
    vocab = set(frequent_loss_tokens(samples, 64, skip).tolist())

    def share(idx):
        ids = [t for i in idx for t, m in zip(samples[i]["input_ids"], samples[i]["loss_mask"]) if m > 0]
        return f"{sum(int(t) in vocab for t in ids) / len(ids):.2%}"

    main([RECIPE, *overrides, "--sizes", "64"])
    printed = capsys.readouterr().out
    assert printed.split(": ", 1)[1].startswith(f"{len(trained)} training samples")
    assert rows(printed)[64][1:] == [share(trained), share(held)]
    with pytest.raises(ValueError, match="train.first_records: no training sample among the first 1 records"):
        main([RECIPE, f"data.features_dir={tmp_path}/none", "data.heldout_fraction=0.99", "train.first_records=1"])


def test_a_report_without_outputs_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "report.json").write_text('{"accept_len": 2.0}')
    with pytest.raises(ValueError, match="bad/report.json: not an evaluation report with outputs"):
        main([RECIPE, f"data.features_dir={tmp_path}/none", "--reports", str(tmp_path / "bad")])
    with pytest.raises(ValueError, match="missing/report.json: no report"):
        main([RECIPE, f"data.features_dir={tmp_path}/none", "--reports", str(tmp_path / "missing")])


def test_no_held_out_split_shows_a_dash(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    main([RECIPE, f"data.features_dir={tmp_path}/none", "data.heldout_fraction=0"])
    assert all(cells[2] == "–" and cells[1].endswith("%") for cells in rows(capsys.readouterr().out).values())
