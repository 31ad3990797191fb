"""data.chatsets: streamed JSON / JSONL conversations, a cut-off tail, prompts (first and later user turns), filters,
benchmark exclusion, the held-out split, the dataset's own answers, and the CLI's errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import data.chatsets as chatsets
from data.chatsets import ChatSetError, Filters, ReadSummary, build, prompt_of, read_records, select_prompts
from data.requests import Contamination, Duplicates, english_problem

ROOT = Path(__file__).resolve().parents[1]


def sharegpt(i: int, *turns: str, first: str = "human") -> dict:
    roles = ["human", "gpt"] if first == "human" else ["gpt", "human"]
    return {"id": f"c{i}", "conversations": [{"from": roles[j % 2], "value": t} for j, t in enumerate(turns)]}


def requests(n: int) -> list[str]:
    """n distinct English requests (distinct enough that no two are near duplicates)."""
    topics = "rivers cameras gardens violins comets bridges glaciers markets tunnels orchards deserts".split()
    verbs = "explain describe compare summarise list".split()
    return [
        f"Please {verbs[i % 5]} how the {topics[i % 11]} of region {i} work, and why it matters {i * 7}"
        for i in range(n)
    ]


def write_array(path: Path, records: list[dict], cut: int = 0) -> bytes:
    """A pretty-printed JSON array like ShareGPT's file; `cut` bytes cut off its end."""
    raw = json.dumps(records, indent=2, ensure_ascii=False).encode()
    path.write_bytes(raw[: len(raw) - cut] if cut else raw)
    return raw


# ------------------------------------------------------------------------------------------------ reading


def test_array_and_lines_read_the_same_records(tmp_path):
    records = [sharegpt(i, q, "an answer") for i, q in enumerate(requests(5))]
    write_array(tmp_path / "a.json", records)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name in ("a.json", "b.jsonl"):
        summary = ReadSummary()
        assert [r for _, r in read_records(tmp_path / name, summary)] == records
        assert (summary.records, summary.bytes_left) == (5, 0)


def test_a_cut_off_array_stops_at_the_last_whole_record_at_any_cut(tmp_path, monkeypatch):
    """Cut at every byte of the last record (with read chunks smaller than a record, so records also straddle chunk
    edges, escapes included): the records before it, and the bytes left are exactly the cut record's."""
    monkeypatch.setattr(chatsets, "CHUNK", 37)
    records = [sharegpt(i, q + ' \\u00e9 caf\u00e9 "quoted"', "answer") for i, q in enumerate(requests(3))]
    raw = write_array(tmp_path / "a.json", records)
    last, end = raw.rindex(b'{\n    "id": "c2"'), raw.rindex(b"}") + 1
    for cut in range(len(raw) - end + 1, len(raw) - last + 1):
        (tmp_path / "a.json").write_bytes(raw[: len(raw) - cut])
        summary = ReadSummary()
        got = [r for _, r in read_records(tmp_path / "a.json", summary)]
        assert got == records[:2], cut
        assert summary.bytes_left == len(raw) - cut - last, cut


def test_cut_off_tail_counts_the_bytes_left(tmp_path):
    records = [sharegpt(i, q, "answer") for i, q in enumerate(requests(3))]
    raw = write_array(tmp_path / "a.json", records)
    start = raw.rindex(b'{\n    "id": "c2"')
    (tmp_path / "a.json").write_bytes(raw[: start + 40])
    summary = ReadSummary()
    assert len(list(read_records(tmp_path / "a.json", summary))) == 2
    assert summary.bytes_left == 40
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records)[:-30])
    summary = ReadSummary()
    assert len(list(read_records(tmp_path / "b.jsonl", summary))) == 2
    assert summary.bytes_left == len(json.dumps(records[2])) + 1 - 30


def test_malformed_json_inside_the_file_is_an_error_naming_the_line(tmp_path):
    records = [sharegpt(i, q, "answer") for i, q in enumerate(requests(3))]
    raw = write_array(tmp_path / "a.json", records).decode()
    broken = raw.replace('"from": "gpt"', '"from" "gpt"', 1)
    (tmp_path / "a.json").write_text(broken)
    with pytest.raises(ChatSetError, match=r"a\.json: line \d+: malformed JSON in record 0"):
        list(read_records(tmp_path / "a.json", ReadSummary()))
    lines = [json.dumps(r) for r in records]
    (tmp_path / "b.jsonl").write_text("\n".join([lines[0], lines[1][:-3], lines[2]]) + "\n")
    with pytest.raises(ChatSetError, match=r"b\.jsonl:2: not a JSON record"):
        list(read_records(tmp_path / "b.jsonl", ReadSummary()))
    (tmp_path / "c.json").write_bytes(b'[{"id": "\xff"}]')
    with pytest.raises(ChatSetError, match=r"c\.json: not UTF-8"):
        list(read_records(tmp_path / "c.json", ReadSummary()))
    (tmp_path / "d.json").write_text("hello")
    with pytest.raises(ChatSetError, match="neither a JSON array"):
        list(read_records(tmp_path / "d.json", ReadSummary()))


# ------------------------------------------------------------------------------------------------ prompts


def test_prompt_of_first_and_later_user_turns():
    rec = sharegpt(0, "first question here", "first answer", "second question here", "second answer", "third one")
    one, why = prompt_of(rec, 0, 1)
    assert why is None and one.messages == [{"role": "user", "content": "first question here"}]
    assert one.answer == "first answer"
    two, _ = prompt_of(rec, 0, 2)
    assert [m["content"] for m in two.messages] == ["first question here", "first answer", "second question here"]
    assert two.answer == "second answer"
    three, _ = prompt_of(rec, 0, 5)
    assert len(three.messages) == 5 and three.answer is None
    empty_reply = sharegpt(1, "first question here", "", "second question here", "x")
    assert len(prompt_of(empty_reply, 1, 3)[0].messages) == 1  # never past an empty assistant turn
    system = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there you"}]}
    assert [m["role"] for m in prompt_of(system, 2, 1)[0].messages] == ["system", "user"]
    assert prompt_of(sharegpt(3, "an answer", "a question", first="gpt"), 3, 1) == (
        None,
        "opens with an assistant turn",
    )
    assert prompt_of({"conversations": []}, 4, 1) == (None, "unreadable record")
    assert prompt_of({"messages": [{"role": "system", "content": "x"}]}, 5, 1) == (None, "no user turn")


def test_filters_duplicates_and_the_heldout_split():
    qs = requests(12)
    records = [sharegpt(i, q, f"answer {i}") for i, q in enumerate(qs[:8])]
    records += [
        sharegpt(8, qs[0].upper() + "!", "dup"),  # the same words as record 0
        sharegpt(9, "ok", "short"),
        sharegpt(10, "Wie funktioniert die Photosynthese in den Blättern der Pflanzen genau?", "de"),
        sharegpt(11, " ".join(["word"] * 300), "long"),
        sharegpt(12, qs[8], "held out"),
        sharegpt(13, qs[1], "held out, but a training request"),
    ]
    train, heldout, copies = select_prompts(records, 12, Filters(), None)
    assert [p.id for p in train.kept] == [f"c{i}" for i in range(8)]
    assert train.removed == {"duplicate": 1, "too short": 1, "not English": 1, "too long": 1}
    assert [p.id for p in heldout.kept] == ["c12"]
    assert heldout.removed == {"duplicate (of a training or earlier held-out prompt)": 1}
    assert copies == []


def test_later_turns_that_fail_a_filter_shorten_the_prompt():
    qs = requests(2)
    rec = sharegpt(0, qs[0], "answer one", "Wie funktioniert die Photosynthese in den Blättern genau?", "answer two")
    train, _, _ = select_prompts([rec], 1, Filters(max_user_turns=2), None)
    (prompt,) = train.kept
    assert prompt.messages == [{"role": "user", "content": qs[0]}] and prompt.answer == "answer one"


def test_benchmark_questions_and_near_copies_stay_out():
    question = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."
    contamination = Contamination({"mtbench-81": question})
    near = "compose an engaging travel blog post about a recent trip to Hawaii highlighting cultural sites please"
    quoted = "My teacher asked: " + question + " Can you help me write it in under 300 words for my class?"
    unrelated = "Write a blog post about my recent trip to the mountains of Peru and the food I ate there."
    assert contamination.match(near).question == "mtbench-81"
    assert contamination.match(quoted).overlap == 1.0
    assert contamination.match(unrelated) is None
    records = [sharegpt(0, near, "a"), sharegpt(1, unrelated, "b"), sharegpt(2, quoted, "c")]
    train, heldout, copies = select_prompts(records, 2, Filters(), contamination)
    assert [p.id for p in train.kept] == ["c1"] and heldout.kept == []
    assert [(c["id"], c["split"], c["question"]) for c in copies] == [
        ("c0", "train", "mtbench-81"),
        ("c2", "heldout", "mtbench-81"),
    ]


def test_request_filters():
    assert english_problem("How do I sort a list in Python by a key?") is None
    assert english_problem("Как отсортировать список в Python?") == "not English"
    d = Duplicates(0.8)
    assert d.why("How do rivers form deltas near the sea?") is None
    assert d.why("how do RIVERS form deltas near the sea") == "duplicate"


# ------------------------------------------------------------------------------------------------ the command


def test_build_writes_splits_answers_and_a_report(tmp_path):
    qs = requests(11)
    records = [
        sharegpt(i, q, f"answer {i}", f"And a follow-up question number {i} about it?", f"more {i}")
        for i, q in enumerate(qs[:10])
    ]
    write_array(tmp_path / "d.json", records, cut=25)
    mt = tmp_path / "mt.jsonl"
    mt.write_text(json.dumps({"id": "q1", "messages": [{"role": "user", "content": qs[3]}]}) + "\n")
    report = build(tmp_path / "d.json", tmp_path / "out", [mt], Filters(max_user_turns=2), 0.25)
    assert report["read"]["records"] == 9 and report["read"]["bytes_left"] > 0
    assert report["heldout_from_record"] == 7
    train = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    heldout = [json.loads(line) for line in (tmp_path / "out" / "heldout.jsonl").read_text().splitlines()]
    fixed = [json.loads(line) for line in (tmp_path / "out" / "train-conversations.jsonl").read_text().splitlines()]
    assert [r["id"] for r in train] == ["c0", "c1", "c2", "c4", "c5", "c6"]
    assert all(len(r["messages"]) == 3 and r["user_turns"] == 2 for r in train)
    assert [r["id"] for r in heldout] == ["c7", "c8"] and all(len(r["messages"]) == 1 for r in heldout)
    assert [r["messages"][-1] for r in fixed][0] == {"role": "assistant", "content": "more 0"}
    assert report["benchmark_copies"][0]["id"] == "c3"
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report


@pytest.mark.slow
def test_cli_reports_the_cut_and_refuses_bad_sources(tmp_path):
    records = [sharegpt(i, q, "answer") for i, q in enumerate(requests(10))]
    write_array(tmp_path / "d.json", records, cut=10)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "data.chatsets", *args], cwd=ROOT, capture_output=True, text=True)

    done = run(str(tmp_path / "d.json"), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "read 9 complete records; the file ends inside the next one" in done.stdout
    assert (tmp_path / "out" / "report.json").is_file()
    missing = run(str(tmp_path / "nope.json"), "--out", str(tmp_path / "o2"))
    assert missing.returncode != 0 and missing.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "nope.json: no such file" in missing.stderr and not (tmp_path / "o2").exists()
    (tmp_path / "bad.json").write_text('[{"id": "a" "conversations": []}]')
    bad = run(str(tmp_path / "bad.json"), "--out", str(tmp_path / "o3"))
    assert bad.returncode != 0 and "bad.json: line 1: malformed JSON in record 0" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "o3" / "report.json").exists()
    turns = run(str(tmp_path / "d.json"), "--out", str(tmp_path / "o4"), "--max-user-turns", "2")
    assert turns.returncode != 0 and "needs --target" in turns.stderr
