#!/usr/bin/env bash
# One build-check-time cycle on the GPU machine: bash tools/gpu_cycle.sh STEP... (results under $OUT).
# Steps: tests (pytest -m gpu), guide-tests, square / llm / skinny (fp16), bf16 (square + llm), tf32 (square),
# learn (copy, grey), profile (host time of one launch, tools/launch_profile.py), fp8 (square, e4m3 and e5m2
# against torch._scaled_mm), fp8-tests (tests/test_fp8_tf32.py on the GPU: real tf32 and fp8).
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
# The device's copy of the tree has no .git: pass the commit so every JSON records it.
[ -n "${TILEGEMM_GIT_COMMIT:-}" ] || echo "WARNING: TILEGEMM_GIT_COMMIT is not set; results will not name their commit"
bench() { python3 -m tilegemm.cli bench --quiet --no-save "$@"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) python3 -m pytest -m gpu -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 25 ;;
    square|llm|skinny) bench --sweep "$step" --dtype fp16 --json "$OUT/$step-fp16.json" ;;
    tf32) bench --sweep square --dtype tf32 --json "$OUT/square-tf32.json" ;;
    fp8) for d in fp8_e4m3 fp8_e5m2; do bench --sweep square --dtype $d --json "$OUT/square-$d.json"; done ;;
    fp8-tests) python3 -m pytest -q -x -p no:cacheprovider tests/test_fp8_tf32.py 2>&1 | tail -n 15 ;;
    guide-tests) python3 -m pytest -m gpu -q -p no:cacheprovider -k "copy or grey or replay" 2>&1 | tail -n 3 ;;
    bf16) for s in square llm; do bench --sweep $s --dtype bf16 --json "$OUT/$s-bf16.json"; done ;;
    learn) bench --op copy --json "$OUT/copy.json"; bench --op grey --json "$OUT/grey.json" ;;
    profile) python3 tools/launch_profile.py 2>&1 | tee "$OUT/launch-profile.txt" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "=== done $(date +%T)"
