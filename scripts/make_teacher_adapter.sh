#!/usr/bin/env bash
# Make src/strop/assets/tiny-math-teacher: a LoRA adapter over the shipped tiny-math model,
# trained by strop's own LoRA-PPO, the teacher of `strop demo distill`.
#
#   scripts/make_teacher_adapter.sh [WORK]     # default WORK=runs/tiny-math-teacher-build
#
# 1. writes strop demo's problems (write_splits(seed=0, n_train=2000, n_validation=256),
#    the same files `strop demo` writes under its run directory) into WORK/data;
# 2. runs `strop ppo demo` (the demo recipe) on the train split only, with more iterations
#    than the demo's 60; the validation split is only scored, every VALIDATE_EVERY iterations;
# 3. exports the actor's LoRA adapter in PEFT format into WORK/adapter and copies it into
#    ASSET, naming its base "tiny-math" (the export names this machine's path to it);
# 4. measures greedy accuracy of the base model and of base + ASSET on the 256 held-out
#    problems with `strop eval` (WORK/eval-base, WORK/eval-teacher).
# ASSET's README.md, the model card, is written by hand from these figures.
#
# Environment: PYTHON (default python), BACKEND (default torch, faster than jax for this
# job on a CPU), STEPS (default 200), VALIDATE_EVERY (default 20), ASSET (default
# src/strop/assets/tiny-math-teacher: run from the repository root).
set -euo pipefail

WORK=${1:-runs/tiny-math-teacher-build}
PYTHON=${PYTHON:-python}
BACKEND=${BACKEND:-torch}
STEPS=${STEPS:-200}
VALIDATE_EVERY=${VALIDATE_EVERY:-20}
ASSET=${ASSET:-src/strop/assets/tiny-math-teacher}
SEED=0

BASE=$("$PYTHON" -c "from strop.assets import tiny_math_path; print(tiny_math_path())")
"$PYTHON" -c "
import sys
from strop.commands.demo import N_TRAIN, N_VALIDATION
from strop.data.synthetic import write_splits
write_splits(sys.argv[1], int(sys.argv[2]), N_TRAIN, N_VALIDATION)
" "$WORK/data" "$SEED"

"$PYTHON" -m strop ppo demo backend="$BACKEND" seed="$SEED" run_dir="$WORK/ppo" \
    model.path="$BASE" data.train_path="$WORK/data/train.jsonl" \
    data.eval_path="$WORK/data/validation.jsonl" \
    ppo.steps="$STEPS" ppo.validate_every="$VALIDATE_EVERY" checkpoint.every_steps="$VALIDATE_EVERY"

"$PYTHON" -m strop export "$WORK/ppo" --adapter --out "$WORK/adapter"
mkdir -p "$ASSET"
cp "$WORK/adapter/adapter_model.safetensors" "$ASSET/"
"$PYTHON" -c "
import json, sys
config = json.load(open(sys.argv[1]))
config['base_model_name_or_path'] = 'tiny-math'
open(sys.argv[2], 'w').write(json.dumps(config, indent=2) + '\\n')
" "$WORK/adapter/adapter_config.json" "$ASSET/adapter_config.json"

for what in base teacher; do
    adapter=()
    [ "$what" = teacher ] && adapter=(eval.adapter="$ASSET")
    "$PYTHON" -m strop eval demo backend="$BACKEND" run_dir="$WORK/eval-$what" \
        model.path="$BASE" eval.path="$WORK/data/validation.jsonl" "${adapter[@]}"
done
