#!/usr/bin/env bash
# Issue 19's GPU measurements in one call on a lent machine (its image has torch, JAX and
# CUDA; nothing can be installed from a registry there). Run from the repository root:
#
#   bash benchmarks/gpu_run.sh            # writes its logs under $OUT (default /tmp/gpu-out)
#
# What strop needs and the image lacks travels as wheels in .whl/ (ignored by git), made
# here with `pip download --no-deps --python-version 3.12 --platform manylinux...`:
#   .whl/missing: pydantic, pydantic-core, annotated-types, typing-inspection, tensorboardX,
#                 math-verify, latex2sympy2_extended, antlr4-python3-runtime, qwix
#   .whl/torch:   the versions strop is tested with: transformers 5.24.0, peft 0.21.2
#   .whl/jax:     optional, likewise (flax 0.12.8 did not import under the image's jax
#                 0.11.2 on 2026-11-26; the image's flax 0.12.10 ran)
# A small smoke run decides per backend whether the pinned wheels or the image's own
# versions are used.
#
# Then: 1. training-step MFU at Qwen2.5-1.5B shapes, sequence 1,024, bf16, both backends,
# LoRA and full (benchmarks/mfu.py); 2. a PPO iteration at those shapes by phase
# (benchmarks/ppo_step.py --shape qwen2.5-1.5b). About 9 minutes on an H200 with an empty
# JAX compile cache (docs/benchmarks.md, "On an H200").
set -u
OUT=${OUT:-/tmp/gpu-out}
SHAPE=${SHAPE:-qwen2.5-1.5b}  # SHAPE=small WHEELS=/nonexistent checks this script on a CPU
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS="" XLA_PYTHON_CLIENT_MEM_FRACTION=0.85
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, jax; print('torch', torch.__version__, torch.cuda.is_available(), 'jax', jax.__version__, jax.devices())" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"

for kind in missing torch jax; do
  ls $WHEELS/$kind/*.whl >/dev/null 2>&1 || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "/tmp/site-$kind" $WHEELS/$kind/*.whl || echo "installing .whl/$kind failed"
done
site() {  # PYTHONPATH with the pinned wheels of the backends named
  local path="$PWD/src:$PWD:/tmp/site-missing"
  for kind in "$@"; do path="$path:/tmp/site-$kind"; done
  echo "$path"
}

smoke() {  # backend, then the pinned wheel sets to try: 0 when a tiny LoRA step runs
  local backend=$1; shift
  PYTHONPATH=$(site "$@") timeout 240 python3 benchmarks/mfu.py --shape small --batch 2 \
    --length 128 --steps 1 --warmup 1 --modes lora --backends "$backend" \
    --json "/tmp/smoke-$backend.json" >>"$OUT/smoke.txt" 2>&1 &&
    python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['results']; sys.exit(any('error' in v for v in r.values()))" "/tmp/smoke-$backend.json"
}
TORCH_SITE=torch; smoke torch torch || TORCH_SITE=  # a failure falls back to the image's
JAX_SITE=
if ls $WHEELS/jax/*.whl >/dev/null 2>&1; then JAX_SITE=jax; smoke jax jax || JAX_SITE=; fi
cat /tmp/smoke-*.json >>"$OUT/smoke.txt" 2>/dev/null
echo "pinned wheels used: torch=${TORCH_SITE:-image} jax=${JAX_SITE:-image}" | tee -a "$OUT/gpu.txt"
export PYTHONPATH=$(site $TORCH_SITE $JAX_SITE)  # one process per backend: both sets are safe

rm -rf /tmp/task
python3 benchmarks/ppo_step.py --shape "$SHAPE" --task /tmp/task --backends 2>&1 | tail -2
timeout 270 python3 benchmarks/mfu.py --model /tmp/task/model --json "$OUT/mfu.json" \
  --timeout 140 2>&1 | tee "$OUT/mfu.txt"
timeout 330 python3 benchmarks/ppo_step.py --shape "$SHAPE" --task /tmp/task --backends torch jax --steps 3 \
  ppo.prompts_per_step=32 ppo.num_generations_per_prompt=4 generation.max_new_tokens=256 \
  ppo.mini_batch_size=64 ppo.micro_batch_size=16 ppo.kl_coef=0 model.dtype=bfloat16 \
  model.param_dtype=bfloat16 lora.rank=16 lora.alpha=32 2>&1 | tee "$OUT/ppo.txt"
