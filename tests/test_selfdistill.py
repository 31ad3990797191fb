"""Self-distillation on a tiny random Llama with the pocket tokenizer: formats, resume, errors."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from tiny import accelerate_launch, save_chat_target
from transformers import AutoTokenizer, GenerationConfig

from data import selfdistill
from data.prepare import tokenize_record, vocab_fingerprint
from data.selfdistill import SelfDistillError, main

ROOT = Path(__file__).resolve().parents[1]
POCKET = ROOT / "recipes" / "pocket" / "target"

PLAIN = [{"id": f"p{i}", "prompt": f"def function_{i}(x):\n    return x + {i}\n"} for i in range(5)] + [
    {"prompt": "import os\n"}  # no id: gets one from its line number
]
CHAT = [
    {
        "id": "openai",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "old answer"},
            {"role": "user", "content": "And then?"},
        ],
    },
    {"id": "sharegpt", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
    {"id": "prompt-only", "messages": [{"role": "user", "content": "Write a haiku."}]},
]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """2-layer random Llama, vocab 8192, saved with the pocket tokenizer. A large init makes the
    next-token distributions peaked, so greedy choices are far from ties."""
    path = tmp_path_factory.mktemp("tiny-target")
    save_chat_target(path, POCKET)
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_records(out: Path) -> list[dict]:
    """Records end at "\\n" only (a JSON string may hold U+2028, which str.splitlines splits at)."""
    return [json.loads(line) for line in out.read_bytes().split(b"\n") if line.strip()]


def run(target: Path, prompts: Path, out: Path, *extra: str) -> list[dict]:
    main(["--target", str(target), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "6", *extra])
    return read_records(out)


def test_plain_records(tiny_target, tmp_path):
    out = run(tiny_target, write_jsonl(tmp_path / "p.jsonl", PLAIN), tmp_path / "out.jsonl", "--batch-size", "4")
    assert [r["id"] for r in out] == [f"p{i}" for i in range(5)] + ["line6"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    for record, source in zip(out, PLAIN):
        assert record["prompt"] == source["prompt"] and isinstance(record["completion"], str)
        assert record["generation"]["max_new_tokens"] == 6 and record["generation"]["temperature"] == 0.0
        assert record["generation"]["finish_reason"][0] in ("stop", "length")
        assert record["generation"]["vocab"] == vocab_fingerprint(tokenizer)  # what its ids mean
        ids = record["completion_ids"]  # the target's own tokens, what data.prepare trains on
        if record["generation"]["finish_reason"][0] == "length":
            assert len(ids) == 6
        else:
            ids = ids[:-1]  # the stop token ends the ids but not the text
        assert (
            tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == record["completion"]
        )
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert meta["settings"]["max_new_tokens"] == 6 and "config.json" in meta["target"]["files"]


def test_chat_records_keep_structure(tiny_target, tmp_path):
    out = run(tiny_target, write_jsonl(tmp_path / "c.jsonl", CHAT), tmp_path / "out.jsonl", "--batch-size", "2")
    openai, sharegpt, prompt_only = out
    assert [m["role"] for m in openai["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert openai["messages"][:2] == CHAT[0]["messages"][:2] and openai["messages"][3] == CHAT[0]["messages"][3]
    assert openai["messages"][2]["content"] != "old answer"
    assert len(openai["generation"]["finish_reason"]) == 2
    assert [t["from"] for t in sharegpt["conversations"]] == ["human", "gpt"]
    assert sharegpt["conversations"][0] == CHAT[1]["conversations"][0]
    assert [m["role"] for m in prompt_only["messages"]] == ["user", "assistant"]


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.9", "--top-p", "0.9", "--seed", "3"]])
def test_resume_equals_uninterrupted_run(tiny_target, tmp_path, sampling):
    prompts = write_jsonl(tmp_path / "mixed.jsonl", PLAIN + CHAT)
    full = run(tiny_target, prompts, tmp_path / "full.jsonl", "--batch-size", "3", *sampling)
    # An interrupted run: two records merged, one batch in a part file, and a torn line in another.
    lines = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "resumed.jsonl").write_text("".join(lines[:2]))
    (tmp_path / "resumed.jsonl.part1").write_text("".join(lines[3:6]) + '{"id": "p7", "prompt": "trunc')
    shutil.copy(tmp_path / "full.jsonl.meta.json", tmp_path / "resumed.jsonl.meta.json")
    resumed = run(tiny_target, prompts, tmp_path / "resumed.jsonl", "--batch-size", "3", *sampling)
    assert (tmp_path / "resumed.jsonl").read_text() == (tmp_path / "full.jsonl").read_text()
    assert [r["id"] for r in resumed] == [r["id"] for r in full] and len(full) == len(PLAIN + CHAT)
    assert not list(tmp_path.glob("*.part*"))  # merged and removed


def test_two_processes_write_the_records_of_one(tiny_target, tmp_path):
    """`accelerate launch` with 2 CPU processes: batches split by index, parts merged in prompt order."""
    prompts = write_jsonl(tmp_path / "mixed.jsonl", PLAIN + CHAT)
    one = run(tiny_target, prompts, tmp_path / "one.jsonl", "--batch-size", "2")
    launch = accelerate_launch("--multi_gpu", "--num_processes", "2")
    args = ["-m", "data.selfdistill", "--target", str(tiny_target), "--prompts", str(prompts)]
    args += ["--out", str(tmp_path / "two.jsonl"), "--max-new-tokens", "6", "--batch-size", "2"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[1/2]" in done.stderr  # the second process did generate
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    assert len(one) == len(PLAIN + CHAT)


def test_chat_records_keep_the_targets_token_ids(tiny_target, tmp_path):
    """`assistant_ids` hold what the target generated; data.prepare trains on exactly those ids."""
    out = run(tiny_target, write_jsonl(tmp_path / "c.jsonl", CHAT), tmp_path / "out.jsonl", "--max-new-tokens", "9")
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    for record in out:
        turns = record["assistant_ids"]
        assert len(turns) == len(record["generation"]["finish_reason"]) >= 1
        ids, mask = tokenize_record(record, tokenizer, "auto", max_len=10_000)
        assert [t for t, m in zip(ids, mask) if m] == [t for turn in turns for t in turn]
        key, text_key = ("messages", "content") if "messages" in record else ("conversations", "value")
        texts = [t[text_key] for t in record[key] if t.get("role", t.get("from")) in ("assistant", "gpt")]
        for turn, text, reason in zip(turns, texts, record["generation"]["finish_reason"]):
            body = turn if reason == "length" else turn[:-1]
            assert tokenizer.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False) == text


@pytest.mark.parametrize(
    "change,why",
    [
        (["--temperature", "0.7"], "--temperature 0.0 there, 0.7 now"),
        (["--batch-size", "3"], r"--batch-size \d+ there, 3 now"),
        (["--seed", "1"], "--seed 0 there, 1 now"),
        ([], r"other prompts \(the prompt file's content differs\)"),
    ],
)
def test_refuses_resume_with_other_settings_or_prompts_naming_what_differs(tiny_target, tmp_path, change, why):
    prompts = write_jsonl(tmp_path / "p.jsonl", PLAIN)
    run(tiny_target, prompts, tmp_path / "out.jsonl", "--limit", "2")
    if not change:
        write_jsonl(prompts, PLAIN[::-1])
    with pytest.raises(SelfDistillError, match=f"out.jsonl holds records made with {why} .*refusing to resume"):
        run(tiny_target, prompts, tmp_path / "out.jsonl", "--limit", "2", *change)


def test_a_larger_limit_extends_the_run_to_what_one_run_writes(tiny_target, tmp_path, monkeypatch):
    """Every record is generated in the batch one run over all the prompts puts it in (its padding, hence its bf16
    numerics, depend on the batch): a limit inside a batch generates the whole batch and writes the records up to
    the limit."""
    prompts = write_jsonl(tmp_path / "p.jsonl", PLAIN + CHAT)
    batches = []
    distill_batch = selfdistill.distill_batch
    monkeypatch.setattr(
        selfdistill, "distill_batch", lambda b, g: batches.append([i for i, _ in b]) or distill_batch(b, g)
    )
    run(tiny_target, prompts, tmp_path / "once.jsonl", "--limit", "7", "--batch-size", "2")
    assert batches == [["p0", "p1"], ["p2", "p3"], ["p4", "line6"], ["openai", "sharegpt"]]
    batches.clear()
    assert len(run(tiny_target, prompts, tmp_path / "grown.jsonl", "--limit", "3", "--batch-size", "2")) == 3
    assert batches == [["p0", "p1"], ["p2", "p3"]]  # p3 generated beside p2, as in the one run, and not written
    run(tiny_target, prompts, tmp_path / "grown.jsonl", "--limit", "7", "--batch-size", "2")
    assert (tmp_path / "grown.jsonl").read_text() == (tmp_path / "once.jsonl").read_text()


def test_refuses_resume_onto_a_target_with_other_weights_of_the_same_size(tiny_target, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", PLAIN)
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    run(target, prompts, tmp_path / "out.jsonl", "--limit", "2")
    weights = target / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # another model of the same shapes: other weight bytes, the same file size
        f.seek(size // 2)
        chunk = f.read(4096)
        f.seek(size // 2)
        f.write(bytes(b ^ 0x01 for b in chunk))
    assert weights.stat().st_size == size
    with pytest.raises(SelfDistillError, match=r"made with another target \(its model.safetensors differs\)"):
        run(target, prompts, tmp_path / "out.jsonl", "--limit", "3")
    # a run whose meta recorded weight files by size alone (earlier versions) still resumes on a same-size file
    meta_path = tmp_path / "out.jsonl.meta.json"
    meta = json.loads(meta_path.read_text())
    meta["target"]["files"]["model.safetensors"] = f"bytes:{size}"
    meta_path.write_text(json.dumps(meta))
    assert [r["id"] for r in run(target, prompts, tmp_path / "out.jsonl", "--limit", "3")] == ["p0", "p1", "p2"]
    meta["target"]["files"]["model.safetensors"] = f"bytes:{size + 1}"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(SelfDistillError, match="another target"):
        run(target, prompts, tmp_path / "out.jsonl", "--limit", "4")


def test_a_conversation_the_template_rejects_is_named_in_one_line(tiny_target, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    template = (target / "chat_template.jinja").read_text()
    guard = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    (target / "chat_template.jinja").write_text(guard + template)
    with pytest.raises(
        SelfDistillError, match=r"^record 'openai', assistant turn 1: chat template rejected .*no system"
    ):
        run(target, write_jsonl(tmp_path / "p.jsonl", CHAT[:1]), tmp_path / "out.jsonl")


def test_prompts_compared_by_content_not_name(tiny_target, tmp_path):
    run(tiny_target, write_jsonl(tmp_path / "p.jsonl", PLAIN[:2]), tmp_path / "out.jsonl")
    edited = [dict(PLAIN[0], prompt="something else"), PLAIN[1]]
    with pytest.raises(SelfDistillError, match="other prompts"):
        run(tiny_target, write_jsonl(tmp_path / "p.jsonl", edited), tmp_path / "out.jsonl")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "p.jsonl:2: invalid JSON"),
        ('{"text": "x"}', "p.jsonl:2: expected a string `prompt`"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', r"p.jsonl:2: messages\[0\]: unknown role"),
        ('{"id": "a", "prompt": "y"}', "p.jsonl:2: duplicate id 'a'"),
    ],
)
def test_malformed_prompt_names_file_and_line(tiny_target, tmp_path, line, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n' + line + "\n")
    with pytest.raises(SelfDistillError, match=message):
        run(tiny_target, prompts, tmp_path / "out.jsonl")


def test_target_generation_defaults_are_ignored(tiny_target, tmp_path):
    """A target whose generation_config samples with a repetition penalty still decodes greedily here."""
    noisy = tmp_path / "noisy-target"
    shutil.copytree(tiny_target, noisy)
    GenerationConfig(do_sample=True, temperature=0.7, top_k=5, repetition_penalty=3.0).save_pretrained(noisy)
    prompts = write_jsonl(tmp_path / "p.jsonl", PLAIN[:3])
    plain = run(tiny_target, prompts, tmp_path / "a.jsonl")
    assert [r["completion"] for r in run(noisy, prompts, tmp_path / "b.jsonl")] == [r["completion"] for r in plain]


def test_a_smaller_limit_keeps_the_order_and_a_line_separator_stays_in_its_record(tiny_target, tmp_path):
    """Sample ids are positions in the file: a re-run with a smaller --limit keeps the order of the larger run's
    records. A prompt holding U+2028 (common in web text; written unescaped) stays one record when parts are merged.
    An output name with glob characters still finds its part files."""
    plain = [{"id": f"p{i}", "prompt": f"def f{i}(x):\n"} for i in range(12)]
    plain[4]["prompt"] = "# one\u2028two\n"
    prompts = write_jsonl(tmp_path / "p.jsonl", plain)
    out = tmp_path / "sd[v2].jsonl"
    run(tiny_target, prompts, out, "--limit", "12", "--batch-size", "4")
    ids = [r["id"] for r in read_records(out)]
    assert ids == [f"p{i}" for i in range(12)] and read_records(out)[4]["prompt"] == "# one\u2028two\n"
    assert [r["id"] for r in run(tiny_target, prompts, out, "--limit", "3", "--batch-size", "4")] == ids
    selfdistill.part_path(out, 0).write_text(out.read_text(encoding="utf-8").split("\n")[4] + "\n", encoding="utf-8")
    assert selfdistill.merge_parts(out, [(r["id"], r) for r in plain]) == 12  # the part's copy is a duplicate
    assert [r["id"] for r in read_records(out)] == ids and not selfdistill.part_files(out)
