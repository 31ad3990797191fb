"""The training loop end to end on tiny random targets: `pytest tests/test_train.py`.

Features come from `data.extract` on the tiny recipes' fixture conversations. In-process runs call
`train.loop.train`; the DDP and DeepSpeed tests launch 2 CPU processes with `accelerate launch`.
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from safetensors.torch import load_file
from tiny import accelerate_launch, reset_accelerate

from data.extract import main as extract_main
from data.loader import BatchLoader
from data.prepare import prepare_dataset
from data.shards import FeatureDataset
from methods import METHODS
from models.target import load_target
from rundir.checkpoints import latest_checkpoint, list_checkpoints
from schema.recipe import load_recipe
from train import loop
from train.__main__ import main as train_main
from train.checkpoint import DRAFTER_FILE, METRICS_FILE
from train.loop import TrainingError, build_target, evaluated_heldout, target_hidden, train
from train.optim import WarmupCosine

pytestmark = pytest.mark.usefixtures("at_root")

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"eagle2": ROOT / "recipes/tiny/eagle2.yaml", "medusa1": ROOT / "recipes/tiny/medusa1.yaml"}
QUIET = ["train.eval_every=0", "train.save_every=0", "train.log_every=1", "logging.tracker=none"]


def extract(features: Path, *overrides: str) -> Path:
    extract_main([str(RECIPES["eagle2"]), f"data.features_dir={features}", *overrides])
    reset_accelerate()
    return features


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Path:
    """Features of the tiny fixture data (both tiny recipes share target, layers and data)."""
    return extract(tmp_path_factory.mktemp("train") / "features")


def recipe(method: str, features: Path, out: Path, *overrides: str):
    return load_recipe(
        RECIPES[method],
        [f"data.features_dir={features}", f"train.output_dir={out}", *QUIET, *overrides],
    )


def losses(out: Path) -> list[float]:
    return [json.loads(line)["train/loss"] for line in (out / METRICS_FILE).read_text().splitlines()]


def trained(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(out) / DRAFTER_FILE))


def initial_drafter(r):
    """The drafter exactly as `train` initialises it (seeded before construction)."""
    target = load_target(**vars(r.target))
    set_seed(r.train.seed)
    return METHODS[r.drafter.method].module()(r.drafter, target.parts(r.data.layers)), target


@pytest.mark.parametrize("method,online", [("eagle2", False), ("medusa1", False), ("eagle2", True)])
def test_step_changes_every_trainable_param_and_keeps_target(method, online, features, tmp_path, monkeypatch):
    r = recipe(
        method, features, tmp_path / "run", "train.max_steps=1", "train.lr=0.01", "train.warmup_steps=0",
        f"train.online={str(online).lower()}",
    )  # fmt: skip
    used = []
    monkeypatch.setattr(loop, "build_target", lambda *args: used.append(build_target(*args)) or used[-1])
    train(r)
    before, fresh = initial_drafter(r)
    after = trained(tmp_path / "run")
    assert after.keys() == before.trainable_state_dict().keys()
    for name, tensor in before.trainable_state_dict().items():
        assert not torch.equal(after[name], tensor), f"{name} did not change"
    state = used[0].model.state_dict()
    for name, tensor in fresh.model.state_dict().items():
        assert torch.equal(state[name], tensor), f"target tensor {name} changed"


@pytest.mark.parametrize("packing", [False, True])
def test_online_hidden_states_equal_extracted_features(packing, features):
    """Online steps compute, inside the step, the hidden states that extraction stored (packed or padded)."""
    r = recipe("eagle2", features, Path("unused"), "train.online=true")
    target = load_target(**vars(r.target))
    stored = FeatureDataset(features)
    by_id = {s["id"]: s for s in prepare_dataset(r.data, target.tokenizer).samples}
    picked = [by_id[stored.sample_ids[i]] for i in (0, 40, 95)]
    loader = BatchLoader(picked, batch_size=3, packing=packing, max_len=1024, shuffle=False)
    batch = next(loader.batches())
    hidden = target_hidden(target, batch, r.data.layers)  # (B, T, 1, d)
    rows = [[0, 1, 2]] if packing else [[0], [1], [2]]
    for b, row in enumerate(rows):
        t = 0
        for k in row:
            want = stored[(0, 40, 95)[k]]["hidden"]  # (T_k, 1, d)
            torch.testing.assert_close(hidden[b, t : t + len(want)], want, rtol=1e-4, atol=1e-5)
            t += len(want)


@pytest.fixture(scope="module")
def four_samples(tmp_path_factory) -> Path:
    return extract(tmp_path_factory.mktemp("few") / "features", "data.max_samples=4")


# EAGLE's soft CE against a random target's near-uniform distribution has an entropy floor; its
# feature regression (like Medusa's hard-label CE) can go to ~0 on one batch.
@pytest.mark.parametrize("method,key", [("eagle2", "train/loss_feat"), ("medusa1", "train/loss")])
def test_overfits_one_batch(method, key, four_samples, tmp_path):
    r = recipe(
        method, four_samples, tmp_path / "run", "data.max_samples=4", "data.heldout_fraction=0", "train.batch_size=4",
        "train.max_steps=25", "train.lr=0.01", "train.warmup_steps=0",
    )  # fmt: skip
    train(r)
    curve = [json.loads(line)[key] for line in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    assert curve[-1] < 0.3 * curve[0], curve
    assert (tmp_path / "run" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn at the checkpoint


def test_curves_draw_losses_and_each_heldout_accuracy(tmp_path):
    """curves.png: the loss and learning rate by step, and one held-out accuracy curve per unrolled step (EAGLE) or
    head (Medusa); a torn last line of a killed run is skipped; no losses, no picture."""
    from train.curves import _ACC, plot_curves

    assert plot_curves(tmp_path) is None
    rows = [{"step": i, "train/loss": 1.0 / i, "train/lr": 1e-3} for i in range(1, 21)]
    rows[9] |= {"eval/acc@1": 0.4, "eval/step1/acc@1": 0.3, "eval/acc@1/head2": 0.2, "eval/acc@5": 0.9}
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 21, "train/lo')
    assert plot_curves(tmp_path) == tmp_path / "curves.png" and (tmp_path / "curves.png").stat().st_size > 1000
    names = [m.group(1) or m.group(2) or "step0" for k in rows[9] if (m := _ACC.match(k))]
    assert sorted(names) == ["head2", "step0", "step1"]  # acc@5 is not drawn


@pytest.mark.parametrize("method", ["eagle2", "medusa1"])
def test_grad_accum_4x1_equals_1x4(method, features, tmp_path):
    common = ["train.max_steps=2", "train.warmup_steps=0", "train.lr=0.01"]
    train(recipe(method, features, tmp_path / "a", "train.batch_size=4", "train.grad_accum=1", *common))
    reset_accelerate()
    train(recipe(method, features, tmp_path / "b", "train.batch_size=1", "train.grad_accum=4", *common))
    torch.testing.assert_close(losses(tmp_path / "a"), losses(tmp_path / "b"), rtol=1e-5, atol=1e-6)
    a, b = trained(tmp_path / "a"), trained(tmp_path / "b")
    # Adam divides by sqrt(v): where a gradient element is ~0 (zero-initialised Medusa W1), float noise between the
    # two summation orders moves the update by up to a few percent of lr (1.3e-4 at lr 1e-2 seen here); a real
    # accumulation error would show in the losses above and in updates of the order of lr.
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=5e-4, msg=name)


def test_restricted_lm_head_scores_exactly_the_chosen_rows(features):
    target = load_target(**vars(load_recipe(RECIPES["eagle2"], [f"data.features_dir={features}"]).target))
    ids = torch.tensor([7, 3, 100, 42])
    parts = target.parts([-1]).restricted(ids)
    h = torch.randn(5, target.config.hidden_size)
    torch.testing.assert_close(parts.lm_head(h), target.lm_head(h)[:, ids])  # the same rows, other GEMM blocking
    assert not parts.lm_head.weight.requires_grad and torch.equal(parts.vocab_ids, ids)


@pytest.mark.parametrize("method", ["eagle2", "medusa1"])
def test_loss_vocab_trains_on_the_frequent_tokens_and_exports_the_same_tensors(method, features, tmp_path):
    """train.loss_vocab: losses over the shards' most frequent loss tokens; the trained tensors are the usual ones."""
    common = ["train.max_steps=2", "train.warmup_steps=0"] + (
        ["drafter.share_lm_head=true"] if method == "medusa1" else []
    )
    train(recipe(method, features, tmp_path / "full", *common))
    reset_accelerate()
    train(recipe(method, features, tmp_path / "one", "train.loss_vocab=1", *common))
    full, one = trained(tmp_path / "full"), trained(tmp_path / "one")
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in one.items()}
    assert any(not torch.equal(full[k], one[k]) for k in full)  # other losses, other updates
    first = json.loads((tmp_path / "one" / METRICS_FILE).read_text().splitlines()[0])
    if method == "eagle2":  # a one-token vocabulary: the target's and the drafter's distributions agree exactly
        assert first["train/loss_ce"] == 0.0 and first["train/acc@1"] == 1.0
    else:  # only positions labelled with the most frequent token count (one row: CE 0, and it always ranks first)
        rows = [json.loads(line) for line in (tmp_path / "one" / METRICS_FILE).read_text().splitlines()]
        heads = [(row[f"train/loss/head{k}"], row[f"train/acc@1/head{k}"]) for row in rows for k in (1, 2, 3)]
        assert all(loss == 0.0 and acc in (0.0, 1.0) for loss, acc in heads) and (0.0, 1.0) in heads, heads


def test_stop_and_resume_reproduces_the_uninterrupted_run(features, tmp_path):
    # input noise draws from the torch RNG; held-out evaluation in between must not disturb anything
    common = ["train.max_steps=6", "train.save_every=3", "train.eval_every=2", "drafter.input_noise=0.05"]
    train(recipe("eagle2", features, tmp_path / "a", *common))
    reset_accelerate()
    r = recipe("eagle2", features, tmp_path / "b", *common)
    assert train(r, stop_after=3).name == "step-000003"
    assert len(losses(tmp_path / "b")) == 3
    with pytest.raises(TrainingError, match="already holds checkpoints"):
        train(r)
    reset_accelerate()
    train(recipe("eagle2", features, tmp_path / "b", *common, "train.resume=auto"))
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    a, b = trained(tmp_path / "a"), trained(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [p.name for p in list_checkpoints(tmp_path / "b")] == ["step-000003", "step-000006"]


def test_nan_loss_stops_naming_step_and_checkpoint(features, tmp_path, monkeypatch):
    train(recipe("eagle2", features, tmp_path / "run", "train.max_steps=2"))
    reset_accelerate()
    getitem = FeatureDataset.__getitem__

    def poisoned(self, i):
        item = getitem(self, i)
        return {**item, "hidden": item["hidden"] * float("nan")}

    monkeypatch.setattr(FeatureDataset, "__getitem__", poisoned)
    r = recipe("eagle2", features, tmp_path / "run", "train.max_steps=4", "train.resume=auto")
    with pytest.raises(
        TrainingError, match=r"non-finite training loss \(nan\) at step 3; last good checkpoint: .*step-0+2"
    ):
        train(r)


def test_an_infinite_gradient_norm_stops_naming_step_and_checkpoint(features, tmp_path):
    """A loss weight of 1e30 keeps the loss finite (about 1e30) while the gradient norm overflows: clipping it would
    turn every weight into nan and the run would end with exit 0. It stops before the optimizer step instead, as a
    non-finite loss does, naming the step and the last good checkpoint."""
    out = tmp_path / "run"
    with pytest.raises(
        TrainingError, match=r"^non-finite gradient norm \((inf|nan)\) at step 1; last good checkpoint: none \("
    ):
        train(recipe("eagle2", features, out, "train.max_steps=2", "drafter.w_ce=1e30"))
    assert not (out / "checkpoints").exists()


def test_a_second_training_into_a_run_directory_in_use_is_refused(features, tmp_path):
    """While another process trains into train.output_dir (here: this test holds its lock), a training into it stops
    before reading or writing anything there, naming the directory and the holder; once free, it trains."""
    from rundir.lock import LOCK_FILE, acquire, release

    out = tmp_path / "run"
    held = acquire(out, "training")
    try:
        with pytest.raises(TrainingError) as refused:
            train(recipe("eagle2", features, out, "train.max_steps=2"))
        message = str(refused.value)
        assert message.startswith(f"{RECIPES['eagle2']}: train.output_dir: {out}: another training is writing there")
        assert f"(pid {os.getpid()}" in message and "\n" not in message
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    finally:
        release(held)
    reset_accelerate()
    train(recipe("eagle2", features, out, "train.max_steps=2"))
    assert latest_checkpoint(out) is not None and not (out / LOCK_FILE).exists()  # released as the run ended


def test_refuses_features_of_another_target_layers_or_data(features, tmp_path):
    with pytest.raises(TrainingError, match=r"target\.weights_sha256.*python -m data\.extract"):
        train(recipe("eagle2", features, tmp_path / "a", "target.seed=1"))
    reset_accelerate()
    with pytest.raises(TrainingError, match=r"built with layers=\[-1\], expected \[1, -1\]"):
        train(recipe("eagle2", features, tmp_path / "b", "data.layers=[1, -1]"))
    reset_accelerate()
    with pytest.raises(TrainingError, match=r"built with max_len=128, expected 64"):
        train(recipe("eagle2", features, tmp_path / "c", "data.max_len=64"))
    reset_accelerate()
    other = tmp_path / "other.jsonl"
    other.write_text((ROOT / "tests/fixtures/tiny-chat.jsonl").read_text())
    with pytest.raises(TrainingError, match=r"built with sources\.train_files=.*tiny-chat\.jsonl.*other\.jsonl"):
        train(recipe("eagle2", features, tmp_path / "d", f"data.train_files=[{other}]"))


def test_resume_refuses_another_recipe(features, tmp_path):
    train(recipe("eagle2", features, tmp_path / "run", "train.max_steps=2"))
    reset_accelerate()
    other = recipe("eagle2", features, tmp_path / "run", "train.max_steps=3", "train.resume=auto", "drafter.w_ce=0.5")
    with pytest.raises(TrainingError, match=r"step-000002: saved with drafter.w_ce=0.1, .* has 0.5; resume with"):
        train(other)
    reset_accelerate()
    (tmp_path / "run" / "recipe.yaml").write_text("target: {}\n")  # not the recipe it was trained with: sections
    with pytest.raises(TrainingError, match="saved with other target/data/drafter settings than"):
        train(other)
    reset_accelerate()
    resized = recipe(
        "eagle2", features, tmp_path / "run", "train.max_steps=3", "train.resume=auto", "train.batch_size=2"
    )
    with pytest.raises(
        TrainingError, match=r"global batch of 4 rows .* resuming with 2 \(2 x 1 x 1\): set train.grad_accum"
    ):
        train(resized)
    reset_accelerate()  # online, positions index other samples (records, not length-sorted shards)
    online = recipe("eagle2", features, tmp_path / "run", "train.max_steps=3", "train.resume=auto", "train.online=true")
    with pytest.raises(TrainingError, match=r"saved with train.online=False, .* has True; the saved data position"):
        train(online)


def test_resume_follows_a_longer_schedule_and_refuses_other_optimizer_settings(features, tmp_path, capsys):
    """Training longer (a larger train.max_steps on resume) continues on the new cosine from the saved step; it used to
    keep the saved schedule and train the extra steps at learning rate 0. Settings the restored optimizer keeps
    (train.lr, head_lr_mult, weight_decay, betas) or that change the loss (loss_vocab) are refused, not ignored."""
    run = tmp_path / "run"
    common = ["train.lr=0.01", "train.warmup_steps=1"]
    train(recipe("eagle2", features, run, "train.max_steps=2", *common))
    reset_accelerate()
    for change in ("train.lr=0.02", "train.head_lr_mult=2", "train.betas=[0.8,0.95]"):
        key = change.split("=")[0]
        with pytest.raises(TrainingError, match=f"saved with {key}=.*: the restored optimizer keeps the saved"):
            train(recipe("eagle2", features, run, "train.max_steps=4", "train.resume=auto", *common, change))
        reset_accelerate()
    train(recipe("eagle2", features, run, "train.max_steps=4", "train.resume=auto", *common))
    assert "from step 2 it follows the recipe's (1 warm-up steps, cosine to 0 at 4)" in capsys.readouterr().out
    logged = [json.loads(line)["train/lr"] for line in (run / METRICS_FILE).read_text().splitlines()]
    curve = WarmupCosine(1, 4)
    torch.testing.assert_close(logged[2:], [0.01 * curve(2), 0.01 * curve(3)])
    torch.testing.assert_close(logged, [0.01, 0.01, 0.0075, 0.0025])  # by hand: 1 warm-up step, then the two cosines


def test_resume_never_unpickles_anything(features, tmp_path):
    """A run directory copied from someone else: pickles where accelerate kept its state (scheduler, RNG, optimizer,
    model) are never loaded; resume reads JSON and safetensors only."""
    run = tmp_path / "run"
    train(recipe("eagle2", features, run, "train.max_steps=2"))
    reset_accelerate()
    ckpt = latest_checkpoint(run)
    proof = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {proof}",))

    for name in (
        "custom_checkpoint_0.pkl",
        "random_states_0.pkl",
        "optimizer.bin",
        "pytorch_model.bin",
        "scheduler.bin",
    ):
        (ckpt / name).write_bytes(pickle.dumps(Payload()))
        torch.save({"x": Payload()}, ckpt / (name + ".pt"))
    train(recipe("eagle2", features, run, "train.max_steps=3", "train.resume=auto"))
    assert not proof.exists()
    assert [m["step"] for m in map(json.loads, (run / METRICS_FILE).read_text().splitlines())] == [1, 2, 3]


def test_resume_names_a_truncated_checkpoint_file(features, tmp_path):
    run = tmp_path / "run"
    train(recipe("eagle2", features, run, "train.max_steps=2"))
    ckpt = latest_checkpoint(run)
    for name in ("optimizer.safetensors", "scheduler.json", "drafter.safetensors"):
        reset_accelerate()
        (tmp_path / "orig").write_bytes((ckpt / name).read_bytes())
        (ckpt / name).write_bytes((tmp_path / "orig").read_bytes()[:50])
        with pytest.raises(TrainingError, match=f"{name}: (unreadable safetensors|not valid JSON)"):
            train(recipe("eagle2", features, run, "train.max_steps=3", "train.resume=auto"))
        (ckpt / name).write_bytes((tmp_path / "orig").read_bytes())


def test_resume_drops_a_torn_last_metrics_line(features, tmp_path):
    run = tmp_path / "run"
    train(recipe("eagle2", features, run, "train.max_steps=2"))
    reset_accelerate()
    with open(run / METRICS_FILE, "a") as f:
        f.write('{"step": 3, "train/lo')  # killed while writing step 3's line
    train(recipe("eagle2", features, run, "train.max_steps=3", "train.resume=auto"))
    assert [m["step"] for m in map(json.loads, (run / METRICS_FILE).read_text().splitlines())] == [1, 2, 3]


def test_resume_with_the_same_global_batch_split_otherwise_matches(features, tmp_path):
    """4 rows x 1 accumulation saved, resumed as 2 rows x 2 accumulations: the same rows per step, so the same
    run (a preempted job restarted on half the processes doubles train.grad_accum the same way)."""
    common = ["train.max_steps=4", "train.save_every=2", "train.lr=0.01"]
    train(recipe("eagle2", features, tmp_path / "a", *common, "train.batch_size=4"))
    reset_accelerate()
    train(recipe("eagle2", features, tmp_path / "b", *common, "train.batch_size=4"), stop_after=2)
    reset_accelerate()
    train(
        recipe(
            "eagle2", features, tmp_path / "b", *common, "train.batch_size=2", "train.grad_accum=2", "train.resume=auto"
        )
    )
    torch.testing.assert_close(losses(tmp_path / "b"), losses(tmp_path / "a"), rtol=1e-5, atol=1e-6)
    a, b = trained(tmp_path / "a"), trained(tmp_path / "b")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_resume_from_an_older_checkpoint_refuses_to_mix_runs(features, tmp_path):
    """Continuing from step 1 while step 2 is there would prune by step number (keeping the old step 2 and
    deleting the new run's checkpoints) and let resume=auto pick the old run up again."""
    run = tmp_path / "run"
    train(recipe("eagle2", features, run, "train.max_steps=2", "train.save_every=1"))
    reset_accelerate()
    older = run / "checkpoints" / "step-000001"
    with pytest.raises(TrainingError, match="holds checkpoints newer than .*step-000001 \\(step-000002\\)"):
        train(recipe("eagle2", features, run, "train.max_steps=3", f"train.resume={older}"))
    assert [p.name for p in list_checkpoints(run)] == ["step-000001", "step-000002"]  # nothing touched


@pytest.mark.parametrize("tracker,where,pattern", [("tensorboard", "run", "*tfevents*"), ("wandb", "run", "*.wandb")])
def test_trackers_log_offline(tracker, where, pattern, features, tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    train(recipe("eagle2", features, tmp_path / "run", "train.max_steps=2", f"logging.tracker={tracker}"))
    assert list((tmp_path / where).rglob(pattern)), f"no {pattern} under {tmp_path / where}"
    assert os.environ.get("WANDB_MODE") == ("offline" if tracker == "wandb" else None)
    if tracker == "wandb":  # files under the run directory; a resumed run continues the same wandb run
        reset_accelerate()
        run = tmp_path / "run"
        train(recipe("eagle2", features, run, "train.max_steps=3", "logging.tracker=wandb", "train.resume=auto"))
        runs = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
        run_id = (run / "wandb_run_id").read_text().strip()
        # offline-run-<time>-<id>, with a "-1" suffix when both runs started in the same second
        assert len(runs) == 2 and all(f"-{run_id}" in name for name in runs), runs


# --------------------------------------------------------------------------------------------
# Multi-process runs (2 CPU processes) against the single-process run with the same global batch


def launch(args: list[str], env: dict[str, str], timeout: int = 240, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = accelerate_launch(*args)
    # ACCELERATE_USE_CPU would turn a DeepSpeed launch into plain DDP (refused): only set where asked.
    full_env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"} | {"OMP_NUM_THREADS": "1", **env}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def single_process_run(features, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    reset_accelerate()
    train(recipe("eagle2", features, out, "train.max_steps=3", "train.batch_size=4", "train.lr=0.01"))
    return out


def shipped_config(name: str) -> list[str]:
    """The repository's own accelerate config file, on 2 processes (DDP on CPU needs ACCELERATE_USE_CPU)."""
    return ["--config_file", str(ROOT / "recipes" / "accelerate" / f"{name}.yaml"), "--num_processes", "2"]


CPU = {"ACCELERATE_USE_CPU": "true"}


# Global batch 4 = 1 process x 4 = 2 processes x 2 (x 1 accumulation) = 2 x 1 x 2 (ZeRO-2 accumulates).
@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,launch_args,env,batch,kind",
    [
        ("ddp", shipped_config("ddp"), CPU, [2, 1], "MULTI_CPU"),
        ("zero2", shipped_config("zero2"), {}, [1, 2], "DEEPSPEED"),
        ("zero3", shipped_config("zero3"), {}, [2, 1], "DEEPSPEED"),
        ("fsdp", shipped_config("fsdp"), {}, [2, 1], "FSDP"),
    ],
)
def test_two_processes_match_one(backend, launch_args, env, batch, kind, features, single_process_run, tmp_path):
    out = tmp_path / backend
    overrides = [
        f"data.features_dir={features}", f"train.output_dir={out}", *QUIET,
        "train.max_steps=3", f"train.batch_size={batch[0]}", f"train.grad_accum={batch[1]}", "train.lr=0.01",
    ]  # fmt: skip
    proc = launch([*launch_args, "-m", "train", str(RECIPES["eagle2"]), *overrides], env)
    global_batch = (
        f"on 2 processes ({kind}, cpu): global batch 4 = train.batch_size {batch[0]} x grad_accum {batch[1]} x 2"
    )
    assert global_batch in proc.stdout  # said up front: a launch that came up with fewer processes is visible
    torch.testing.assert_close(losses(out), losses(single_process_run), rtol=1e-4, atol=1e-5)
    one, two = trained(single_process_run), trained(out)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_zero3_online_matches_one_process(features, tmp_path):
    """Online under ZeRO-3: the target runs in the step while ZeRO-3 partitions the drafter, which borrows the
    target's embedding and lm_head unregistered (so they are never partitioned, and the run is not refused)."""
    common = [*QUIET, "train.online=true", "train.max_steps=3", "train.lr=0.01"]
    single = tmp_path / "single"
    train(recipe("eagle2", features, single, *common, "train.batch_size=4"))
    out = tmp_path / "zero3"
    launch(
        ["--use_deepspeed", "--zero_stage", "3", "--num_processes", "2", "-m", "train", str(RECIPES["eagle2"])]
        + [f"data.features_dir={features}", f"train.output_dir={out}", *common, "train.batch_size=2"],
        {},
    )
    torch.testing.assert_close(losses(out), losses(single), rtol=1e-4, atol=1e-5)
    one, two = trained(single), trained(out)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def four_steps(features, tmp_path_factory) -> Path:
    """4 uninterrupted steps on one process with batch 4: what every world-size change must reproduce."""
    out = tmp_path_factory.mktemp("four") / "run"
    reset_accelerate()
    train(recipe("eagle2", features, out, "train.max_steps=4", "train.batch_size=4", "train.lr=0.01"))
    return out


def _run(features, out, processes, backend, batch, accum, resume):
    """4 steps of the tiny EAGLE recipe: the first 2 then stop (resume=False), or the rest (resume=True)."""
    overrides = [f"data.features_dir={features}", f"train.output_dir={out}", *QUIET, "train.max_steps=4"]
    overrides += ["train.lr=0.01", f"train.batch_size={batch}", f"train.grad_accum={accum}"]
    args = ["--resume"] if resume else ["--stop-after", "2"]
    if processes == 1:
        reset_accelerate()
        train_main([str(RECIPES["eagle2"]), *overrides, *args])
    else:
        launch(
            [*shipped_config(backend), "-m", "train", str(RECIPES["eagle2"]), *overrides, *args],
            CPU if backend == "ddp" else {},
        )


# (processes, batch, accumulation) before and after the restart; the global batch stays 4 rows.
@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,before,after",
    [
        ("ddp", (2, 2, 1), (1, 2, 2)),
        ("ddp", (1, 4, 1), (2, 2, 1)),
        ("zero2", (2, 1, 2), (1, 4, 1)),
        ("zero3", (1, 2, 2), (2, 2, 1)),
        ("fsdp", (2, 2, 1), (1, 4, 1)),
    ],
)
def test_resume_on_another_number_of_processes(backend, before, after, features, four_steps, tmp_path):
    """A preempted job restarted on another number of processes: the data position, the optimizer moments and
    the schedule carry over exactly (ZeRO shards them by process; checkpoints hold them whole, by name)."""
    out = tmp_path / "run"
    _run(features, out, before[0], backend, *before[1:], resume=False)
    assert len(losses(out)) == 2
    _run(features, out, after[0], backend, *after[1:], resume=True)
    torch.testing.assert_close(losses(out), losses(four_steps), rtol=1e-4, atol=1e-5)
    one, two = trained(four_steps), trained(out)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5, msg=name)


SEED_SCRIPT = """
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from train.loop import seed_process_streams

acc = Accelerator(cpu=True)
set_seed(0)
alike = gather_object([torch.rand(3).tolist()])
seed_process_streams(acc, 0)
own = gather_object([torch.rand(3).tolist()])
if acc.is_main_process:
    print("after set_seed:", "same" if alike[0] == alike[1] else "differ")
    print("after seed_process_streams:", "same" if own[0] == own[1] else "differ")
acc.wait_for_everyone()
torch.distributed.destroy_process_group()  # a process leaving with its group alive can abort at shutdown
"""


@pytest.mark.slow
def test_each_process_draws_its_own_noise(tmp_path):
    """One seed builds identical drafters on every process; the training streams (input noise, dropout) must then
    differ per process, or every process perturbs its batch with the same pattern."""
    script = tmp_path / "seeds.py"
    script.write_text(SEED_SCRIPT)
    out = launch([*shipped_config("ddp"), str(script)], CPU).stdout
    assert "after set_seed: same" in out and "after seed_process_streams: differ" in out, out


@pytest.mark.slow
def test_a_bad_shard_hashed_by_one_process_stops_every_process(features, tmp_path):
    """With 2 processes each hashes half of the shards; rank 1's (shards 1, 3, ...) holds the flipped byte, rank 0
    finds nothing wrong, and both stop before any step with the one line naming the shard."""
    copy = tmp_path / "features"
    shutil.copytree(features, copy)
    assert len(list(copy.glob("shard-*.safetensors"))) >= 2
    victim = copy / "shard-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    out = tmp_path / "run"
    args = [f"data.features_dir={copy}", f"train.output_dir={out}", *QUIET, "train.max_steps=2", "train.batch_size=2"]
    # the launcher polls its workers every 5 s (0.1 s by default) and would stop rank 0 as soon as rank 1 failed;
    # slowed down, it lets rank 0 show that it stops by itself, with the same message
    slow = ["--monitor_interval", "5"]
    proc = launch([*shipped_config("ddp"), *slow, "-m", "train", str(RECIPES["eagle2"]), *args], CPU, ok=False)
    assert proc.returncode != 0
    start = f"error: {RECIPES['eagle2']}: data.features_dir: {victim}: sha256 "
    # the repair command as the user ran training: the recipe and its overrides, so it repairs these features
    end = f"; re-run `python -m data.extract {shlex.join([str(RECIPES['eagle2']), *args])}` to repair it"
    # once per process (both write to one pipe, so the two lines may come interleaved)
    assert proc.stderr.count(start) == proc.stderr.count(end) == 2, proc.stderr[-4000:]
    assert proc.stderr.count("data.extract") == 2  # the fix said once per message
    assert not (out / "checkpoints").exists() and not (out / METRICS_FILE).exists()


@pytest.mark.slow
def test_a_launch_into_a_run_directory_in_use_stops_every_process(features, tmp_path):
    """Two processes of one launch share their main process's lock: when another training holds the directory, the
    main process is refused and the other learns it before any collective it would wait in forever; both stop with
    the one line naming the directory, and nothing is written."""
    from rundir.lock import acquire, release

    out = tmp_path / "run"
    args = [f"data.features_dir={features}", f"train.output_dir={out}", *QUIET, "train.max_steps=2"]
    held = acquire(out, "training")
    try:
        proc = launch([*shipped_config("ddp"), "-m", "train", str(RECIPES["eagle2"]), *args], CPU, ok=False)
    finally:
        release(held)
    assert proc.returncode != 0
    line = f"error: {RECIPES['eagle2']}: train.output_dir: {out}: another training is writing there (pid {os.getpid()}"
    assert proc.stderr.count(line) == 2, proc.stderr[-4000:]  # once per process
    tracebacks = proc.stderr.split("Traceback (most recent call last):")[1:]  # only the launcher's own, if any
    assert all("accelerate/commands/launch.py" in t[:300] for t in tracebacks) and len(tracebacks) <= 1, proc.stderr
    assert not (out / "checkpoints").exists() and not (out / METRICS_FILE).exists()


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero2", "fsdp"])
def test_a_deepspeed_or_fsdp_launch_that_came_up_as_plain_ddp_is_refused(config, features, tmp_path):
    out = tmp_path / "run"
    args = [f"data.features_dir={features}", f"train.output_dir={out}", *QUIET, "train.max_steps=2"]
    proc = launch([*shipped_config(config), "-m", "train", str(RECIPES["eagle2"]), *args], CPU, ok=False)
    assert proc.returncode != 0
    asked = "DeepSpeed" if config == "zero2" else "FSDP"
    assert f"error: the launch asked for {asked} but accelerate set up MULTI_CPU" in proc.stderr
    assert "Traceback" not in proc.stderr.split("error: the launch")[0][-300:]
    assert not (out / "checkpoints").exists()


def test_the_fp16_loss_scale_is_checkpointed_as_json(tmp_path, capsys):
    """With fp16 mixed precision accelerate keeps a GradScaler (GPU only, so a CPU one stands in): its scale and
    growth tracker go into the checkpoint's JSON state and come back on resume, so a resumed run skips the same
    overflowing steps as the uninterrupted one."""
    from types import SimpleNamespace

    from train.resume import restore_scaler, scaler_state

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for value in (float("inf"), 1.0):  # one overflow (scale halves), one good step (growth tracker 1)
        scaler.scale((p * value).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    saved = json.loads(json.dumps(scaler_state(SimpleNamespace(scaler=scaler))))
    assert saved["scale"] == 512.0 and saved["_growth_tracker"] == 1
    fresh = SimpleNamespace(scaler=torch.amp.GradScaler("cpu", growth_interval=3), is_main_process=True)
    restore_scaler(fresh, saved, tmp_path)
    assert fresh.scaler.state_dict() == scaler.state_dict()
    restore_scaler(fresh, None, tmp_path)  # a checkpoint without one: said, and the scaler is left as it is
    assert "holds no fp16 loss scale" in capsys.readouterr().out
    assert scaler_state(SimpleNamespace(scaler=None)) is None


def test_heldout_evaluation_scores_a_random_subset_not_the_shortest_samples():
    """Feature shards are stored by length, so the held-out split's first batches are its shortest samples: an
    evaluation capped at eval_batches x batch_size draws them at random (seeded), the same on any process count."""
    heldout = list(range(3, 203))  # positions in storage order, i.e. by length
    picked = evaluated_heldout(heldout, 16, seed=0)
    assert len(picked) == 16 and picked == sorted(set(picked)) and set(picked) <= set(heldout)
    assert picked == evaluated_heldout(heldout, 16, seed=0) != evaluated_heldout(heldout, 16, seed=1)
    assert sum(p >= 103 for p in picked) >= 4  # the longer half is drawn from too
    assert evaluated_heldout(heldout[:10], 16, seed=0) == heldout[:10]  # a small split: all of it


def test_online_training_with_a_target_cut_into_pieces_equals_the_whole_target(features, tmp_path, monkeypatch):
    """`target.device_map` in online training: the target's layers run in pieces (every other one offloaded to disk)
    and the run's losses and drafter equal those with the whole target."""
    from tiny import count_offloaded_loads, cut_map

    loads = count_offloaded_loads(monkeypatch)
    r = recipe("eagle2", features, tmp_path / "unused")
    load_target(**vars(r.target)).model.save_pretrained(tmp_path / "target")
    layers = r.target.size("num_hidden_layers")
    common = ["target.random_init=", f"target.path={tmp_path / 'target'}", "train.online=true", "train.max_steps=3"]
    placed = [f"target.device_map={json.dumps(cut_map(layers))}", f"target.offload_folder={tmp_path / 'offload'}"]
    reset_accelerate()
    train(recipe("eagle2", features, tmp_path / "whole", *common))
    reset_accelerate()
    train(recipe("eagle2", features, tmp_path / "cut", *common, *placed))
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")
    assert "Linear" in loads  # the odd layers' weights really came from the disk for their forwards
    whole, cut = trained(tmp_path / "whole"), trained(tmp_path / "cut")
    assert whole.keys() == cut.keys() and all(torch.equal(whole[k], cut[k]) for k in whole)


def test_a_device_map_that_training_cannot_use_is_refused(features, tmp_path):
    """Online training with `target.device_map`: the drafter borrows the target's embedding and head, so a map that
    offloads them is refused naming them; Medusa-2, which trains the target's layers, refuses any map."""
    from accelerate import Accelerator
    from tiny import cut_map

    r = recipe("eagle2", features, tmp_path / "unused")
    load_target(**vars(r.target)).model.save_pretrained(tmp_path / "target")
    layers = r.target.size("num_hidden_layers")
    on_path = ["target.random_init=", f"target.path={tmp_path / 'target'}", f"target.offload_folder={tmp_path / 'o'}"]
    offloaded_head = json.dumps(cut_map(layers) | {"lm_head": "disk"})
    reset_accelerate()
    accelerator = Accelerator(cpu=True)
    with pytest.raises(TrainingError, match=r"borrows the target's lm_head \(meta\)"):
        build_target(recipe("eagle2", features, tmp_path / "a", *on_path, f"target.device_map={offloaded_head}"),
                     accelerator)  # fmt: skip
    placed = f"target.device_map={json.dumps(cut_map(layers))}"
    overrides = [*on_path, placed, f"data.features_dir={features}", f"train.output_dir={tmp_path / 'b'}", *QUIET]
    medusa2 = load_recipe(ROOT / "recipes/tiny/medusa2.yaml", overrides)
    with pytest.raises(TrainingError, match="medusa2 trains the target's own layers"):
        build_target(medusa2, accelerator)
    reset_accelerate()
