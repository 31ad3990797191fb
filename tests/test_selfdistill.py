"""Self-distillation on a tiny random Llama with the pocket tokenizer: formats, resume, errors."""

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import accelerate_launch, save_chat_target
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from data import generation, selfdistill, selfdistill_parts
from data.engines import EngineError, engine_devices
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
    fifth = out.read_text(encoding="utf-8").split("\n")[4]
    selfdistill_parts.part_path(out, 0).write_text(fifth + "\n", encoding="utf-8")
    assert selfdistill_parts.merge_parts(out, [(r["id"], r) for r in plain]) == 12  # the part's copy is a duplicate
    assert [r["id"] for r in read_records(out)] == ids and not selfdistill_parts.part_files(out)


# --engine vllm without vLLM: the CI suite has none (`make check-vllm-selfdistill` runs the real one). A stand-in
# `vllm` package on PYTHONPATH, run by this Python in the worker process, generates greedily with transformers one
# sequence at a time (no padding); everything else is the real path: the worker, its protocol, the records.
FAKE_VLLM = {
    "__init__.py": '''
"""A stand-in for vllm in tests: `LLM.generate` greedy with transformers, one sequence at a time."""
import os
import signal
import types

import torch
from transformers import AutoModelForCausalLM

__version__ = "0.0+fake"


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class LLM:
    def __init__(self, model, dtype, seed, trust_remote_code, skip_tokenizer_init, generation_config, **kwargs):
        assert skip_tokenizer_init and generation_config == "vllm" and dtype == "float32", (dtype, kwargs)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=64))

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm=True):
        if os.environ.get("FAKE_VLLM_DIE"):
            os.kill(os.getpid(), signal.SIGKILL)
        outs = []
        for prompt, p in zip(prompts, params):
            ids, new = list(prompt["prompt_token_ids"]), []
            while len(new) < p.max_tokens and (not new or new[-1] not in p.stop_token_ids):
                new.append(int(self.model(torch.tensor([ids + new])).logits[0, -1].argmax()))
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=new)]))
        return outs
''',
    "platforms.py": 'import types\ncurrent_platform = types.SimpleNamespace(is_cpu=lambda: True, device_type="cpu")\n',
}


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> list[str]:
    """`--engine vllm` arguments that run the stand-in vLLM in this Python."""
    package = tmp_path / "fake-vllm" / "vllm"
    package.mkdir(parents=True)
    for name, text in FAKE_VLLM.items():
        (package / name).write_text(text)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")]))
    return ["--engine", "vllm", "--engine-python", sys.executable]


def test_vllm_engine_writes_the_records_of_the_hf_engine_and_resumes(tiny_target, tmp_path, fake_vllm):
    """Greedy records through the vLLM worker equal the HF engine's, with `engine` in their settings only; a window
    of several batches gives the same records, and an interrupted run resumes to the uninterrupted one."""
    prompts = write_jsonl(tmp_path / "mixed.jsonl", PLAIN + CHAT)
    hf = run(tiny_target, prompts, tmp_path / "hf.jsonl", "--batch-size", "2")
    vllm = run(tiny_target, prompts, tmp_path / "vllm.jsonl", "--batch-size", "2", "--engine-window", "2", *fake_vllm)
    assert all("engine" not in r["generation"] for r in hf) and all(r["generation"]["engine"] == "vllm" for r in vllm)
    for r in vllm:
        del r["generation"]["engine"]
    assert vllm == hf
    meta = json.loads((tmp_path / "vllm.jsonl.meta.json").read_text())
    assert meta["settings"]["engine"] == "vllm" and (tmp_path / "vllm.jsonl.vllm0.log").is_file()
    wide = run(tiny_target, prompts, tmp_path / "wide.jsonl", "--batch-size", "2", "--engine-window", "5", *fake_vllm)
    assert (tmp_path / "wide.jsonl").read_text() == (tmp_path / "vllm.jsonl").read_text() and len(wide) == 9
    lines = (tmp_path / "vllm.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "resumed.jsonl").write_text("".join(lines[:2]))
    (tmp_path / "resumed.jsonl.part1").write_text("".join(lines[4:6]) + '{"id": "p7", "prompt": "trunc')
    shutil.copy(tmp_path / "vllm.jsonl.meta.json", tmp_path / "resumed.jsonl.meta.json")
    run(tiny_target, prompts, tmp_path / "resumed.jsonl", "--batch-size", "2", *fake_vllm)
    assert (tmp_path / "resumed.jsonl").read_text() == (tmp_path / "vllm.jsonl").read_text()


def test_vllm_engine_stops_where_the_hf_engine_does(tiny_target, tmp_path, fake_vllm):
    """The stop tokens come from the target's generation config without loading the model: with a frequent token
    made an EOS token, records stop there (the stop token last), in both engines alike, and a later chat turn is
    rendered after a turn that stopped."""
    prompts = write_jsonl(tmp_path / "mixed.jsonl", PLAIN + CHAT)
    first = run(tiny_target, prompts, tmp_path / "first.jsonl", "--max-new-tokens", "9")
    counts = collections.Counter(
        t for r in first for ids in [r.get("completion_ids")] + r.get("assistant_ids", [[]]) for t in ids or []
    )
    stop = counts.most_common(1)[0][0]
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    GenerationConfig(eos_token_id=[AutoTokenizer.from_pretrained(target).eos_token_id, stop]).save_pretrained(target)
    hf = run(target, prompts, tmp_path / "hf.jsonl", "--max-new-tokens", "9")
    vllm = run(target, prompts, tmp_path / "vllm.jsonl", "--max-new-tokens", "9", *fake_vllm)
    assert "stop" in {reason for r in hf for reason in r["generation"]["finish_reason"]}
    assert [r.get("completion_ids", r.get("assistant_ids")) for r in vllm] == [
        r.get("completion_ids", r.get("assistant_ids")) for r in hf
    ]
    assert [r["generation"]["finish_reason"] for r in vllm] == [r["generation"]["finish_reason"] for r in hf]
    (target / "generation_config.json").unlink()  # then the model's config, as transformers loads it
    model = AutoModelForCausalLM.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    settings = generation.GenerationSettings("x", 4, 0.0, 1.0, 0, "auto", 1)
    assert generation.Generator(model, tokenizer, settings).stop_ids == generation.stop_token_ids(
        generation.target_eos(str(target)), tokenizer
    )


def test_a_meta_file_without_engine_resumes_as_hf_and_another_engine_is_refused(tiny_target, tmp_path):
    """Runs recorded before there was a choice of engine were HF runs: they resume with --engine hf (the default),
    and either engine refuses the other's output before starting anything."""
    prompts = write_jsonl(tmp_path / "p.jsonl", PLAIN)
    run(tiny_target, prompts, tmp_path / "out.jsonl", "--limit", "2")
    meta_path = tmp_path / "out.jsonl.meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["settings"].pop("engine") == "hf"
    meta_path.write_text(json.dumps(meta))
    assert [r["id"] for r in run(tiny_target, prompts, tmp_path / "out.jsonl", "--limit", "3")] == ["p0", "p1", "p2"]
    assert json.loads(meta_path.read_text())["settings"]["engine"] == "hf"
    python = ["--engine-python", "/nonexistent/python"]  # never started: the refusal comes first
    with pytest.raises(SelfDistillError, match=r"made with --engine 'hf' there, 'vllm' now .*refusing to resume"):
        run(tiny_target, prompts, tmp_path / "out.jsonl", "--limit", "3", "--engine", "vllm", *python)
    meta = json.loads(meta_path.read_text())
    meta["settings"]["engine"] = "vllm"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(SelfDistillError, match=r"made with --engine 'vllm' there, 'hf' now .*refusing to resume"):
        run(tiny_target, prompts, tmp_path / "out.jsonl", "--limit", "3")


def test_vllm_engine_errors_are_one_line(tiny_target, tmp_path, fake_vllm):
    """No vLLM in the engine's Python, a Python that cannot be run, a worker killed while generating, an input
    longer than vLLM's context, an argument the settings own: each a one-line error naming it, none a hang."""
    prompts = write_jsonl(tmp_path / "p.jsonl", PLAIN[:2])
    out = tmp_path / "out.jsonl"
    cases = [
        ({"PYTHONPATH": ""}, [], r"--engine vllm: no vLLM in \S+ \(ModuleNotFoundError: No module named 'vllm'\)"),
        ({}, ["--engine-python", str(tmp_path / "none")], r"--engine-python \S+none cannot be run \(No such file"),
        ({"FAKE_VLLM_DIE": "1"}, [], r"worker \(\S+\) was killed by SIGKILL while generating 2 sequences; the last"),
        ({}, ["--max-new-tokens", "60"], r"an input of \d+ tokens and --max-new-tokens 60 do not fit .* 64"),
        ({}, ["--engine-args", '{"dtype": "float16"}'], r"--engine-args may not set dtype \(the target and the"),
    ]
    for env, extra, message in cases:
        for path in tmp_path.glob("out.jsonl*"):
            path.unlink()
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            with pytest.raises(SelfDistillError, match=message) as error:
                run(tiny_target, prompts, out, *fake_vllm, *extra)
        assert "\n" not in str(error.value)


def test_each_data_parallel_engine_gets_its_own_accelerators():
    assert engine_devices([], 0, 2, 1) is None  # CPU
    assert engine_devices(["0", "1"], 0, 1, 1) is None  # one process: vLLM takes what is visible
    assert [engine_devices(["4", "5", "6", "7"], i, 2, 2) for i in (0, 1)] == ["4,5", "6,7"]
    assert engine_devices(["0", "1", "2", "3"], 3, 4, 1) == "3"
    with pytest.raises(EngineError, match="4 processes x 2 accelerator.* need 8, and 4 are visible"):
        engine_devices(["0", "1", "2", "3"], 0, 4, 2)


def test_a_second_self_distillation_into_the_same_out_is_refused(tiny_target, tmp_path):
    """While another run writes --out (this test holds its lock, beside the file), a run into it stops with one line
    naming --out and the holder before writing anything (no part file, no meta); once free, it runs, and no lock
    file stays behind."""
    from rundir.lock import acquire, release

    prompts, out = write_jsonl(tmp_path / "p.jsonl", PLAIN), tmp_path / "out.jsonl"
    held = acquire(out, "self-distillation", beside=True)
    try:
        with pytest.raises(SelfDistillError, match=rf"^--out: {out}: another self-distillation is writing there"):
            run(tiny_target, prompts, out)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".out.jsonl.specdraft.lock", "p.jsonl"]
    finally:
        release(held)
    assert len(run(tiny_target, prompts, out)) == len(PLAIN)
    assert not any(p.name.endswith(".specdraft.lock") for p in tmp_path.iterdir())


def test_a_target_cut_into_pieces_writes_the_whole_targets_records(tiny_target, tmp_path, monkeypatch):
    """`--device-map` (HF engine): the target's layers in pieces (every other one offloaded to disk, run by
    accelerate's hooks) write the records of the whole target; with vLLM the option is refused."""
    from tiny import count_offloaded_loads, cut_map

    prompts = write_jsonl(tmp_path / "mixed.jsonl", PLAIN + CHAT)
    loads = count_offloaded_loads(monkeypatch)
    whole = run(tiny_target, prompts, tmp_path / "whole.jsonl", "--batch-size", "3", "--dtype", "float32")
    placed = ["--device-map", json.dumps(cut_map(2)), "--offload-folder", str(tmp_path / "offload")]
    cut = run(tiny_target, prompts, tmp_path / "cut.jsonl", "--batch-size", "3", "--dtype", "float32", *placed)
    assert cut == whole
    assert "Linear" in loads  # the odd layers' weights really came from the disk for their forwards
    with pytest.raises(SystemExit):
        run(tiny_target, prompts, tmp_path / "never.jsonl", "--engine", "vllm", *placed)
