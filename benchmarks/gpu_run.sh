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
# Then the steps named in $STEPS (default "mfu ppo"), each a benchmark:
#   mfu             training-step MFU at Qwen2.5-1.5B shapes, sequence 1,024, bf16, both
#                   backends, LoRA and full (benchmarks/mfu.py)
#   mfu-torch-lora  the same, torch LoRA only
#   ppo             a PPO iteration at those shapes by phase (benchmarks/ppo_step.py)
#   ppo-torch-MODE  the same, torch only, generation.compile=MODE (auto, off,
#                   reduce-overhead, ...)
#   decode          the torch sampler eager, compiled and with CUDA graphs, LoRA r16,
#                   128 prompts x 256 new tokens (benchmarks/rollout.py)
#   dpo             a DPO step at those shapes, 8 pairs of 256 prompt + 2 x 256 answer
#                   tokens, bf16, both backends, LoRA (reference: adapters off) and full
#                   (reference: a frozen copy) (benchmarks/dpo_step.py), up to 8 minutes
# "mfu ppo" take about 9 minutes on an H200 with an empty JAX compile cache
# (docs/benchmarks.md, "On an H200"). A second call on the still-warm machine skips the
# set-up (the choice of wheels is kept in /tmp/gpu-site).
set -u
OUT=${OUT:-/tmp/gpu-out}
SHAPE=${SHAPE:-qwen2.5-1.5b}  # SHAPE=small DEVICE=cpu WHEELS=/nonexistent: a CPU check
WHEELS=${WHEELS:-.whl}
DEVICE=${DEVICE:-cuda}        # DEVICE=cpu with SHAPE=small
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS="" XLA_PYTHON_CLIENT_MEM_FRACTION=0.85
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, jax; print('torch', torch.__version__, torch.cuda.is_available(), 'jax', jax.__version__, jax.devices())" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"

STEPS=${STEPS:-mfu ppo}
site() {  # PYTHONPATH with the pinned wheels of the backends named
  local path="$PWD/src:$PWD:/tmp/site-missing"
  for kind in "$@"; do path="$path:/tmp/site-$kind"; done
  echo "$path"
}
if [[ -f /tmp/gpu-site ]]; then
  read -r TORCH_SITE JAX_SITE </tmp/gpu-site
else
  for kind in missing torch jax; do
    ls $WHEELS/$kind/*.whl >/dev/null 2>&1 || continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "/tmp/site-$kind" $WHEELS/$kind/*.whl || echo "installing .whl/$kind failed"
  done

  smoke() {  # backend, then the pinned wheel sets to try: 0 when a tiny LoRA step runs
    local backend=$1; shift
    PYTHONPATH=$(site "$@") timeout 240 python3 benchmarks/mfu.py --shape small --batch 2 \
      --length 128 --steps 1 --warmup 1 --modes lora --backends "$backend" \
      --json "/tmp/smoke-$backend.json" >>"$OUT/smoke.txt" 2>&1 &&
      python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['results']; sys.exit(any('error' in v for v in r.values()))" "/tmp/smoke-$backend.json"
  }
  TORCH_SITE=torch; smoke torch torch || TORCH_SITE=  # a failure falls back to the image's
  JAX_SITE=
  uses_jax() { local step; for step in $STEPS; do [[ $step == mfu || $step == ppo || $step == dpo ]] && return 0; done; return 1; }
  if uses_jax && ls $WHEELS/jax/*.whl >/dev/null 2>&1; then JAX_SITE=jax; smoke jax jax || JAX_SITE=; fi
  cat /tmp/smoke-*.json >>"$OUT/smoke.txt" 2>/dev/null
  echo "pinned wheels used: torch=${TORCH_SITE:-image} jax=${JAX_SITE:-image}" | tee -a "$OUT/gpu.txt"
  echo "${TORCH_SITE:-} ${JAX_SITE:-}" >/tmp/gpu-site
fi
export PYTHONPATH=$(site $TORCH_SITE $JAX_SITE)  # one process per backend: both sets are safe

[[ -f /tmp/task/model/config.json ]] ||
  python3 benchmarks/ppo_step.py --shape "$SHAPE" --task /tmp/task --backends 2>&1 | tail -2
PPO_JOB=(ppo.prompts_per_step=32 ppo.num_generations_per_prompt=4 generation.max_new_tokens=256
  ppo.mini_batch_size=64 ppo.micro_batch_size=16 ppo.kl_coef=0 model.dtype=bfloat16
  model.param_dtype=bfloat16 lora.rank=16 lora.alpha=32)
for step in $STEPS; do
  echo "== $step $(date +%T)" | tee -a "$OUT/gpu.txt"
  case $step in
    mfu) timeout 270 python3 benchmarks/mfu.py --model /tmp/task/model --json "$OUT/mfu.json" \
      --timeout 140 2>&1 | tee "$OUT/mfu.txt" ;;
    mfu-torch-lora) timeout 150 python3 benchmarks/mfu.py --model /tmp/task/model --backends torch \
      --modes lora --json "$OUT/mfu-torch-lora.json" --timeout 140 2>&1 | tee "$OUT/mfu-torch-lora.txt" ;;
    ppo) timeout 330 python3 benchmarks/ppo_step.py --shape "$SHAPE" --task /tmp/task --backends torch jax \
      --steps 3 "${PPO_JOB[@]}" 2>&1 | tee "$OUT/ppo.txt" ;;
    ppo-torch*) timeout 330 python3 benchmarks/ppo_step.py --shape "$SHAPE" --task /tmp/task \
      --backends torch --steps 3 "${PPO_JOB[@]}" generation.compile=${step#ppo-torch-} 2>&1 |
      tee "$OUT/$step.txt" ;;
    decode) timeout 300 python3 benchmarks/rollout.py --model /tmp/task/model --device "$DEVICE" \
      --batch 128 --new-tokens 256 --lora-rank 16 --systems ${DECODE_SYSTEMS:-torch torch-compiled torch-graphs} 2>&1 |
      tee "$OUT/decode.txt" ;;
    dpo) timeout 480 python3 benchmarks/dpo_step.py --model /tmp/task/model --device "$DEVICE" \
      --json "$OUT/dpo.json" --timeout 150 2>&1 | tee "$OUT/dpo.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
