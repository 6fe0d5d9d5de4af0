#!/usr/bin/env bash
# One build-check-time cycle on the GPU machine: bash tools/gpu_cycle.sh STEP... (results under $OUT).
# Steps:
#   tests         every GPU-marked test (pytest -m gpu), 8 xdist workers (compiling is CPU-bound)
#   gpu-suite     the non-GPU-marked tests that compile for the GPU here too (matmul, bench, guide, core, learn)
#   fingerprint   sm_90 PTX fingerprints of every shipped kernel and config (tools/ptx_fingerprint.py)
#   square|llm|skinny  bench sweeps, fp16;  bf16 (square + llm);  tf32 (square);  fp8 (square, e4m3 and e5m2)
#   square-auto   square fp16 and bf16, auto and persistent_tma only (the behaviour check after a refactor)
#   learn         copy and grey;  profile  host time of one launch (tools/launch_profile.py)
#   w4a16|conv2d  the family's bench on its GPU sweep;  family-tests: tests/w4a16 tests/conv2d tests/nn on the GPU
#   random        the random sweep (fp16, auto only; \$RANDOM_DTYPES for others)
#   conv2d-check  tools/conv2d_gpu_check.py (every layer checked, timed within \$CONV_BUDGET seconds, fp16)
#   w4a16-check   tools/w4a16_gpu_check.py --quick;  first-call  tools/first_call.py
#   w4a16-small   research/explore_w4a16_small_m.py (cold-L2 times of the small-M candidates, \$W4_BUDGET s)
#   conv2d-fwd    the conv2d bench's forward sweeps (resnet50, mobilenet; auto only);  conv2d-nchw  forward and
#                 backward on NCHW tensors, both sides (--memory-format nchw)
#   fuzz          the public ops' GPU fuzz (tests/*/test_*_fuzz_gpu.py; \$TILEGEMM_FUZZ_EXAMPLES draws per op)
#   models        the bench's models sweep, fp16, auto only
#   batched       the bench's batched sweep, fp16 NN and NT, auto only
#   conv2d-explore  research/explore_depthwise.py (with research/depthwise_cols.py) and
#                 research/explore_gluon_narrow.py, \$EXPLORE_BUDGET s for the first
# Put bench steps before `tests`: right after the test workers a bench read unchanged layers up to 2x slower
# (a busy host; benchmarks/results/2026-11-25-h200/8f6320b/*-after-tests-noisy.json).
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
# The device's copy of the tree has no .git: pass the commit so every JSON records it.
[ -n "${TILEGEMM_GIT_COMMIT:-}" ] || echo "WARNING: TILEGEMM_GIT_COMMIT is not set; results will not name their commit"
bench() { python3 -m tilegemm.cli bench --quiet --no-save "$@"; }
pytest_() { python3 -m pytest -q -p no:cacheprovider "$@"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) pytest_ -m gpu -n 8 tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 15 ;;
    gpu-suite) pytest_ -n 8 tests/matmul tests/bench tests/guide tests/core tests/learn 2>&1 | tee "$OUT/gpu-suite.log" | tail -n 15 ;;
    family-tests) pytest_ -m "" -n 8 tests/w4a16 tests/conv2d tests/nn 2>&1 | tee "$OUT/family-tests.log" | tail -n 15 ;;
    fingerprint) TRITON_INTERPRET=0 TILEGEMM_INTERPRET=0 python3 tools/ptx_fingerprint.py --out "$OUT/fingerprints.json" ;;
    square|llm|skinny) bench --sweep "$step" --dtype fp16 --json "$OUT/$step-fp16.json" ;;
    square-auto) for d in fp16 bf16; do bench --sweep square --dtype $d --kernels auto,persistent_tma --json "$OUT/square-auto-$d.json"; done ;;
    tf32) bench --sweep square --dtype tf32 --json "$OUT/square-tf32.json" ;;
    fp8) for d in fp8_e4m3 fp8_e5m2; do bench --sweep square --dtype $d --json "$OUT/square-$d.json"; done ;;
    bf16) for s in square llm; do bench --sweep $s --dtype bf16 --json "$OUT/$s-bf16.json"; done ;;
    learn) bench --op copy --json "$OUT/copy.json"; bench --op grey --json "$OUT/grey.json" ;;
    profile) python3 tools/launch_profile.py 2>&1 | tee "$OUT/launch-profile.txt" ;;
    random) for d in ${RANDOM_DTYPES:-fp16}; do bench --sweep random --dtype $d --kernels auto --json "$OUT/random-$d.json" 2>&1 | tail -n 6; done ;;
    conv2d-check) python3 tools/conv2d_gpu_check.py --dtypes "${CONV_DTYPES:-fp16}" --budget "${CONV_BUDGET:-180}" --out "$OUT/conv2d-check.json" 2>&1 | tee "$OUT/conv2d-check.log" | tail -n 8 ;;
    w4a16-check) python3 tools/w4a16_gpu_check.py --quick --out "$OUT/w4a16-quick.json" 2>&1 | tee "$OUT/w4a16-quick.log" | tail -n 25 ;;
    w4a16-small) python3 research/explore_w4a16_small_m.py --out "$OUT" --budget "${W4_BUDGET:-240}" \
                   ${W4_ARGS:-} 2>&1 | tee "$OUT/small-m.log" | tail -n 20 ;;
    conv2d-fwd) for s in resnet50 mobilenet; do bench --op conv2d --sweep $s --kernels auto --json "$OUT/conv2d-$s-fwd.json" 2>&1 | tail -n 3; done ;;
    conv2d-explore) PYTHONPATH=src:research python3 research/explore_depthwise.py --out "$OUT/depthwise.json" \
                      --budget "${EXPLORE_BUDGET:-240}" 2>&1 | grep -v Warning | tail -n 60
                    PYTHONPATH=src:research python3 research/explore_gluon_narrow.py --out "$OUT/gluon-narrow.json" \
                      2>&1 | grep -v Warning | tail -n 60 ;;
    conv2d-nchw) for s in resnet50 mobilenet; do for m in fwd bwd; do bench --op conv2d --sweep $s --kernels auto \
                   --mode $m --memory-format nchw --json "$OUT/conv2d-$s-$m-nchw.json" 2>&1 | tail -n 3; done; done ;;
    fuzz) for t in matmul conv2d w4a16; do pytest_ -m gpu -x tests/$t/test_${t}_fuzz_gpu.py > "$OUT/fuzz-$t.log" 2>&1
            echo "fuzz $t: $(tail -n 1 "$OUT/fuzz-$t.log")"; done ;;
    models) bench --sweep models --dtype fp16 --kernels auto --json "$OUT/models-fp16.json" 2>&1 | tail -n 6 ;;
    batched) for l in NN NT; do bench --sweep batched --layout $l --dtype fp16 --kernels auto \
               --json "$OUT/batched-fp16-$l.json" 2>&1 | tail -n 4; done ;;
    first-call) python3 tools/first_call.py --out "$OUT/first-call.json" 2>&1 | tail -n 20 ;;
    w4a16|conv2d) bench --op "$step" --json "$OUT/$step.json" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "=== done $(date +%T)"
