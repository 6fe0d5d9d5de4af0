#!/usr/bin/env bash
# One build-check-time cycle on the GPU machine: bash tools/gpu_cycle.sh STEP... (results under $OUT).
# Steps:
#   tests         every GPU-marked test (pytest -m gpu), \$GPU_WORKERS xdist workers (default 12: compiling is
#                 CPU-bound); longer than one call, so tests-a and tests-b (or tests-FOLDER) split it
#   tests-a|tests-b  the GPU-marked tests of conv2d, grouped, w4a16 (tests-b) and of every other folder (tests-a);
#                 tests-b runs past one call's limit: tests-conv2d, tests-grouped, tests-w4a16 (also -nn, -models,
#                 -matmul) run one folder's, tests-rest those of tests-a's other folders
#   gpu-suite     the non-GPU-marked tests that compile for the GPU here too (matmul, bench, guide, core, learn)
#   fingerprint   sm_90 PTX fingerprints of every shipped kernel and config (tools/ptx_fingerprint.py)
#   square|llm|skinny  bench sweeps, fp16;  bf16 (square + llm);  tf32 (square);  fp8 (square, e4m3 and e5m2)
#   square-auto   square fp16 and bf16, auto and persistent_tma only (the behaviour check after a refactor)
#   learn         copy and grey;  profile  host time of one launch (tools/launch_profile.py)
#   w4a16|conv2d  the family's bench on its GPU sweep;  family-tests: tests/w4a16 tests/conv2d tests/nn on the GPU
#   random        the random sweep (fp16, auto only; \$RANDOM_DTYPES for others)
#   conv2d-check  tools/conv2d_gpu_check.py (every layer checked, timed within \$CONV_BUDGET seconds, fp16)
#   w4a16-check   tools/w4a16_gpu_check.py --quick;  first-call  tools/first_call.py;  route  tools/call_route.py
#   conv2d-fwd    the conv2d bench's forward sweeps (resnet50, mobilenet; auto only);  conv2d-nchw  forward and
#                 backward on NCHW tensors, both sides (--memory-format nchw)
#   recheck       the GPU tests not yet run on a GPU, and the files of the last run's failures (edit the list)
#   fuzz          the public ops' GPU fuzz (tests/*/test_*_fuzz_gpu.py; \$TILEGEMM_FUZZ_EXAMPLES draws per op)
#   fuzz-wide     conv2d's (each of its two draws), W4A16's and grouped's GPU fuzz at 512, 504 and 256 draws, in
#                 8, 6 and 2 processes side by side, each its own \$TILEGEMM_FUZZ_SEED, from \$FUZZ_SEED_BASE + 1
#                 (default 0) up (about 2 minutes before conv2d's wide draw and grouped's gated and MoE-sized draws
#                 were added; untimed since); a line a seed in fuzz-wide.txt, failing logs kept; each process
#                 stopped after \$FUZZ_TIMEOUT seconds (default 900), its log then counted as failing
#   models        the bench's models sweep, fp16, auto only
#   batched       the bench's batched sweep, fp16 NN and NT, auto only
#   grouped       the grouped family's moe sweep, bf16 and fp16 forward (auto);  grouped-bwd  its backward, bf16;
#                 grouped-batched  the batched sweep, bf16 and fp16;  grouped-w4a16  4-bit experts on the moe sweep,
#                 fp16 and bf16;  grouped-tests  tests/grouped on the GPU (all marks);  grouped-tma  the moe sweep,
#                 bf16 and fp16, auto against tiled and tma by name, then tma's tests on the GPU
#   grouped-tma-k tools/grouped_bwd_probe.py (the backward's dA and dB by kernel, the sweep's 5 slowest cases), tma_k's
#                 tests on the GPU, then the moe backward sweep, bf16, as CUDA graphs, auto against F.grouped_mm
#   grouped-w4a16-prefill  4-bit experts at 512, 4096 and 16384 tokens (the moe sweep's models and products), fp16
#                 and bf16, auto against dequant_dot and dequant_grouped by name, then their tests on the GPU
#   grouped-candidates  tools/grouped_candidates.py: the moe sweep's weakest cases (forward, \$GC_DTYPES, default
#                 bf16), baselines, auto, and tiled, tma and gluon by name on a grid of configs around auto's, CUDA-graph
#                 times (\$GC_BUDGET seconds a dtype, default 150; \$GC_CASES: the tool's --cases, default weak);
#                 grouped-gluon  kernel gluon's tests, interpreter and GPU
#   grouped-frag  tools/grouped_frag_candidates.py: frag, auto and dequant_dot at 1, 8 and 64 tokens, bf16 on the
#                 bench's routing and fp16 and bf16 on a held-out routing seed (\$FRAG_SEED, default 61001; about
#                 30 s each)
#   functorch     torch.func over the public ops on the GPU (tests/core/test_functorch.py, all marks)
#   grouped-rules tools/grouped_rule_candidates.py: auto's rule variants (knobs) on Mixtral's down projection at
#                 512/4096/16384 tokens and the batched sweep, against the benches' baselines, CUDA graphs (~3 minutes)
#   moe-route     tools/moe_route_probe.py (the MoE routing kernels and group_columns against the torch ops, decode
#                 to prefill), then the routing, act-order experts and MoE checkpoint tests on the GPU
#   grouped-host  tools/grouped_host_probe.py (host us per call at decode: full path, replay, F.grouped_mm; cProfile),
#                 then tests/grouped/test_grouped_replay_gpu.py
#   conv2d-host   tools/conv2d_host_probe.py (host us per replayed conv2d forward: SE 1x1, 3x3 56x56; cProfile),
#                 then tests/conv2d/test_conv2d_host_gpu.py and the conv2d replay tests
#   conv2d-grouped  tools/conv2d_grouped_candidates.py (the zoo's grouped layers of at most 64 channels a group:
#                 cuDNN, auto, grouped_packed's candidates; CONV_BUDGET seconds, default 150), then the GPU tests of
#                 grouped_packed
#   moe-model     the MoE model entries: Qwen3-30B-A3B shapes (\$MOE_LAYERS, default 24), 16-bit and 4-bit experts
#                 against transformers' grouped_mm and batched_mm, decode b1/b16 graph and compile, prefill 2048, bf16
#                 (\$MOE_SHAPES: --shape options for fewer cases; \$MOE_TIMEOUT seconds an entry, default 280)
#   w4-random     the w4a16 bench's held-out w4-random sweep, fp16 (second baseline: fbgemm where it imports)
#   w4-frag-small tools/w4a16_frag_sweep.py at M = 1, 4 and 16 with inputs rotated past L2 (the small-M K split)
#   w4-formats    the w4a16 bench's formats sweep (every group size, sym/asym, act-order), fp16 and bf16, auto and
#                 frag_wgmma
#   w4-checkpoint a Llama-3-8B-shaped GPTQ checkpoint (tools/write_w4_checkpoint.py, 32 layers, \$W4_CKPT_DIR),
#                 then the loader's tests on the GPU and `bench --op w4a16 --model llama --checkpoint` on it (auto, fused)
#   zoo           the conv2d bench's zoo sweep (every convolution of torchvision's classification models), parts
#                 \$ZOO_PART (default 0/8; several, space-separated; a kind of layer too: stem, depthwise:0/4, ...),
#                 \$ZOO_GRAPH=1 as CUDA graphs, mode \$ZOO_MODE (fwd), dtypes \$ZOO_DTYPES (fp16), auto only (log in
#                 \$OUT/conv2d-zoo-*.log; its precompile lines and last lines shown);
#                 zoo-models  --op conv2d --model NAME (b32 eager and graph, b1 eager, b32 train) for \$ZOO_MODELS
#                 (the issue's models but ResNet-50, whose entry is --model resnet50), dtype \$ZOO_DTYPE (fp16)
#   w4-fused      the w4a16 model entries (llama, qwen2) and the 4-bit Qwen3-MoE entry with row fused beside auto
#                 (fuse_projections_: q/k/v and gate/up joined), decode b1/b16, then tests/nn/test_fuse_projections.py
#   fold-models   the conv2d model entries (\$ZOO_MODELS) with row fold beside auto (convert_(fold_batchnorm=True)):
#                 b32 eager and graph, b1 eager, \$ZOO_DTYPE (fp16)
#   dw-wgrad      research/depthwise_wgrad_rows.py: the depthwise weight gradient (a tap or a filter row a program, 2-32
#                 programs an SM) and grouped_direct's (2-32) against cuDNN on the zoo's layers
#   dw-5x5        research/depthwise_wgrad_rows.py on the zoo's stride-1 5x5 depthwise layers (the weakest of the
#                 depthwise backward): the walking weight gradient's rule, a row a program at 1, 2 and 4 channels a
#                 thread and 2 or 8 programs an SM, beside auto's data gradient against cuDNN's (which half loses)
#   dw-cols       research/depthwise_wgrad_rows.py, 10 layers of each kind: the walking weight gradient with its output
#                 columns in 1, 2, 4 or 8 runs a program (COLS: more programs where channel blocks and row tiles are few)
#   dw-cols-heldout  research/depthwise_wgrad_rows.py on the zoo's depthwise layers the column-runs rule splits
#                 (walk_column_runs), those of dw-cols' fitting run left out: the rule against one run a program
#   dgrad-fwd     research/dgrad_as_forward.py: the stride-1 depthwise and grouped data gradients as forward
#                 convolutions against the direct kernels and cuDNN (\$DGRAD_DTYPES, default fp16; \$DGRAD_BUDGET
#                 seconds a dtype, default 150), then tests/conv2d/test_dgrad_as_forward.py and the replay tests
#   dgrad-strided research/dgrad_as_forward.py --strided: the zoo's strided depthwise and grouped data gradients,
#                 auto (their phase convolutions) against the direct kernels and cuDNN (GPU time; \$DGRAD_BUDGET)
#   wide-steps    research/wide_steps.py: the zoo's dense layers of 16 * odd channels (48, 80, 112, 144), auto with the
#                 wider K steps off and on against cuDNN (\$CONV_BUDGET seconds, default 150), their data gradients
#                 (--dgrad, 100 s), then the padded route's GPU tests
#   tma-tiles     research/tma_tiles.py: the zoo's dense layers of at most 64 output channels on the TMA kernel, its
#                 config against 256- and 512-pixel tiles on 4 or 8 warps (\$CONV_BUDGET seconds, default 200)
#   cublas-1x1    tools/cublas_kernels.py on the GEMMs of eight stride-1 1x1 zoo layers where cuBLAS leads tilegemm's
#                 GEMM (docs/conv2d.md, "The zoo"): which kernel, tile and split cuBLAS runs, and how long each takes
#   narrow-1x1    research/narrow_1x1.py: the zoo's 1x1 layers of at most 64 channels in and 128 out, cuDNN, auto,
#                 cuBLAS and a memory-bound kernel at six configs (\$CONV_BUDGET seconds, default 150)
#   conv2d-odd    the conv2d bench's odd sweep (channels a group not multiples of 16: the padded route), forward
#                 (auto and the pointer kernel it replaced) and backward (auto), fp16 and bf16; then its GPU tests
# $PRECOMPILE: worker processes that compile a bench sweep's kernels before it is timed (default 15; 0 off).
# Put bench steps before `tests`: right after the test workers a bench read unchanged layers up to 2x slower
# (a busy host; benchmarks/results/2026-11-25-h200/8f6320b/*-after-tests-noisy.json).
set -uo pipefail
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # the caller's path kept (wheels installed with --target)
OUT=${OUT:-out}; mkdir -p "$OUT"
# The device's copy of the tree has no .git: pass the commit so every JSON records it.
[ -n "${TILEGEMM_GIT_COMMIT:-}" ] || echo "WARNING: TILEGEMM_GIT_COMMIT is not set; results will not name their commit"
# Every bench sweep first compiles its kernels in $PRECOMPILE worker processes (default 15 of the 16 CPUs;
# 0 turns it off; docs/bench.md, "Precompiling"); a --model entry compiles in its own calls and is left alone.
bench() {
  local pre=(--precompile "${PRECOMPILE:-15}")
  case " $* " in *" --model "*) pre=() ;; esac
  python3 -m tilegemm.cli bench --quiet --no-save ${pre[@]+"${pre[@]}"} "$@"
}
pytest_() { python3 -m pytest -q -p no:cacheprovider "$@"; }
# GPU tests: -v writes each result's name as it lands, so a run the call's limit cuts still names its failures
# (the log keeps them; the failures and the last lines are shown)
# (the fuzz tests at 100 draws each here: at their default 500 one worker runs them one after another past a call's
# limit; fuzz-wide is the wide draw)
gpu_tests() { local log=$1; shift
  TILEGEMM_FUZZ_EXAMPLES=${TILEGEMM_FUZZ_EXAMPLES:-100} python3 -m pytest -v -p no:cacheprovider --tb=short -rf -m gpu -n "${GPU_WORKERS:-12}" "$@" > "$log" 2>&1
  grep -E "^\[gw[0-9]+\].* (FAILED|ERROR) " "$log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort | uniq | head -n 60
  tail -n 2 "$log"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) gpu_tests "$OUT/gpu-tests.log" tests ;;
    tests-a) gpu_tests "$OUT/gpu-tests-a.log" tests/matmul tests/bench tests/core tests/nn tests/models tests/parallel \
               tests/guide tests/learn tests/docs tests/examples ;;
    tests-b) gpu_tests "$OUT/gpu-tests-b.log" tests/conv2d tests/grouped tests/w4a16 ;;
    tests-rest) gpu_tests "$OUT/gpu-tests-rest.log" tests/bench tests/core tests/parallel tests/guide tests/learn \
                  tests/docs tests/examples ;;
    tests-conv2d|tests-grouped|tests-w4a16|tests-nn|tests-models|tests-matmul)
      gpu_tests "$OUT/gpu-$step.log" "tests/${step#tests-}" ;;
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
    w4-random) bench --op w4a16 --sweep w4-random --dtype fp16 --json "$OUT/w4a16-w4-random-fp16.json" 2>&1 | tail -n 30 ;;
    w4-frag-small)  # frag_wgmma's configs at M = 1, 4, 16 on the fitting draws, inputs rotated past L2 (the K split's fill)
                PYTHONPATH=src:tools timeout 470 python3 tools/w4a16_frag_sweep.py --ms 1,4,16 --rotate --budget 380 \
                  --out "$OUT/w4-frag-small.json" 2>&1 | tail -n 14 ;;
    w4-formats) for d in fp16 bf16; do bench --op w4a16 --sweep formats --dtype $d --kernels auto,frag_wgmma \
                  --json "$OUT/w4a16-formats-$d.json" 2>&1 | tail -n 8; done ;;
    w4-checkpoint) ckpt=${W4_CKPT_DIR:-/tmp/llama3-8b-gptq}
                   [ -f "$ckpt/config.json" ] || python3 tools/write_w4_checkpoint.py --out "$ckpt" 2>&1 | tail -n 2
                   pytest_ -m "" tests/models 2>&1 | tee "$OUT/models-tests.log" | tail -n 8
                   bench --op w4a16 --model llama --checkpoint "$ckpt" --kernels auto,fused --json "$OUT/w4a16-llama-checkpoint.json" 2>&1 | tail -n 25 ;;
    w4a16-check) python3 tools/w4a16_gpu_check.py --quick --out "$OUT/w4a16-quick.json" 2>&1 | tee "$OUT/w4a16-quick.log" | tail -n 25 ;;
    conv2d-fwd) for s in resnet50 mobilenet; do bench --op conv2d --sweep $s --kernels auto --json "$OUT/conv2d-$s-fwd.json" 2>&1 | tail -n 3; done ;;
    conv2d-nchw) for s in resnet50 mobilenet; do for m in fwd bwd; do bench --op conv2d --sweep $s --kernels auto \
                   --mode $m --memory-format nchw --json "$OUT/conv2d-$s-$m-nchw.json" 2>&1 | tail -n 3; done; done ;;
    recheck) pytest_ -m "" -n 14 -rf tests/w4a16/test_w4a16_frag_wgmma.py tests/w4a16/test_w4a16_matmul.py \
               tests/nn/test_nn_contract.py tests/nn/test_int4_fragments.py tests/grouped/test_grouped_act_order.py \
               tests/matmul/test_rungs.py tests/conv2d/test_wgrad_split.py tests/core/test_tuning.py \
               tests/models/test_models_moe_checkpoint.py tests/conv2d/test_conv2d_padded.py 2>&1 \
               | tee "$OUT/recheck.log" | tail -n 15 ;;
    fuzz) for t in matmul conv2d w4a16 grouped; do pytest_ -m gpu -x tests/$t/test_${t}_fuzz_gpu.py > "$OUT/fuzz-$t.log" 2>&1
            echo "fuzz $t: $(tail -n 1 "$OUT/fuzz-$t.log")"; done ;;
    fuzz-wide) b=${FUZZ_SEED_BASE:-0}
               for s in $(seq $((b + 1)) $((b + 8))); do TILEGEMM_FUZZ_SEED=$s TILEGEMM_FUZZ_EXAMPLES=64 \
                 timeout "${FUZZ_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/conv2d/test_conv2d_fuzz_gpu.py > "$OUT/fuzz-conv2d-$s.log" 2>&1 & done
               for s in $(seq $((b + 1)) $((b + 6))); do TILEGEMM_FUZZ_SEED=$s TILEGEMM_FUZZ_EXAMPLES=84 \
                 timeout "${FUZZ_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/w4a16/test_w4a16_fuzz_gpu.py > "$OUT/fuzz-w4a16-$s.log" 2>&1 & done
               for s in $(seq $((b + 1)) $((b + 2))); do TILEGEMM_FUZZ_SEED=$s TILEGEMM_FUZZ_EXAMPLES=128 \
                 timeout "${FUZZ_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/grouped/test_grouped_fuzz_gpu.py > "$OUT/fuzz-grouped-$s.log" 2>&1 & done
               wait
               # one summary and the failing seeds' logs only: the device returns a limited number of files
               for f in "$OUT"/fuzz-conv2d-*.log "$OUT"/fuzz-w4a16-*.log "$OUT"/fuzz-grouped-*.log; do
                 echo "$(basename "$f"): $(tail -n 1 "$f")"
                 grep -q " passed" "$f" && ! grep -q "failed" "$f" || cat "$f" >> "$OUT/fuzz-wide-failures.log"
                 rm -f "$f"; done | tee "$OUT/fuzz-wide.txt" ;;
    models) bench --sweep models --dtype fp16 --kernels auto --json "$OUT/models-fp16.json" 2>&1 | tail -n 6 ;;
    batched) for l in NN NT; do bench --sweep batched --layout $l --dtype fp16 --kernels auto \
               --json "$OUT/batched-fp16-$l.json" 2>&1 | tail -n 4; done ;;
    grouped) for d in bf16 fp16; do bench --op grouped --sweep moe --dtype $d --kernels auto \
               --json "$OUT/grouped-moe-$d.json" 2>&1 | tail -n 6; done ;;
    grouped-bwd) bench --op grouped --sweep moe --dtype bf16 --mode bwd --kernels auto \
                   --json "$OUT/grouped-moe-bf16-bwd.json" 2>&1 | tail -n 6 ;;
    grouped-batched) for d in bf16 fp16; do bench --op grouped --sweep batched --dtype $d --kernels auto \
                       --json "$OUT/grouped-batched-$d.json" 2>&1 | tail -n 6; done ;;
    grouped-w4a16) for d in fp16 bf16; do bench --op grouped_w4a16 --sweep moe --dtype $d --kernels auto \
                     --json "$OUT/grouped-w4a16-moe-$d.json" 2>&1 | tail -n 6; done ;;
    moe-model) for o in grouped grouped_w4a16; do  # about 4 and 3 minutes at 24 layers (compiles included)
                 timeout -s INT "${MOE_TIMEOUT:-280}" python3 -m tilegemm.cli bench --quiet --no-save --op $o \
                   --model qwen3_moe --layers "${MOE_LAYERS:-24}" ${MOE_SHAPES:-} --json "$OUT/moe-$o-qwen3.json" 2>&1 | grep -E "│ b|auto  |wrong|error" | tail -n 16
               done ;;
    grouped-tma) for d in bf16 fp16; do bench --op grouped --sweep moe --dtype $d --kernels auto,tiled,tma \
                   --json "$OUT/grouped-moe-tma-$d.json" 2>&1 | tail -n 8; done
                 pytest_ -m "" tests/grouped/test_grouped_tma.py tests/grouped/test_grouped_tma_gpu.py 2>&1 \
                   | tee "$OUT/grouped-tma-tests.log" | tail -n 15 ;;
    grouped-tma-k) python3 tools/grouped_bwd_probe.py --boundary --out "$OUT/grouped-bwd-probe.json" 2>&1 \
                     | tee "$OUT/grouped-bwd-probe.txt" | tail -n 24
                   pytest_ -m "" tests/grouped/test_grouped_tma_k.py tests/grouped/test_grouped_tma_k_gpu.py 2>&1 \
                     | tee "$OUT/grouped-tma-k-tests.log" | tail -n 15
                   bench --op grouped --sweep moe --dtype bf16 --mode bwd --cuda-graph --kernels auto \
                     --json "$OUT/grouped-moe-bf16-bwd-graph.json" 2>&1 | tail -n 8 ;;
    grouped-w4a16-prefill)
        shapes=()
        for m in 8,2,4096,14336 128,8,2048,768 64,6,2048,1408; do for t in 512 4096 16384; do
            for prod in gate_up down; do shapes+=(--shape "$m,$t,$prod"); done; done; done
        for d in fp16 bf16; do bench --op grouped_w4a16 "${shapes[@]}" --dtype $d \
            --kernels auto,dequant_dot,dequant_grouped --json "$OUT/grouped-w4a16-prefill-$d.json" 2>&1 | tail -n 8; done
        pytest_ -m "" tests/grouped/test_grouped_int4_prefill.py tests/grouped/test_grouped_int4_prefill_gpu.py 2>&1 \
            | tee "$OUT/grouped-w4a16-prefill-tests.log" | tail -n 15 ;;
    grouped-candidates) for d in ${GC_DTYPES:-bf16}; do
                          python3 tools/grouped_candidates.py --dtype $d --budget "${GC_BUDGET:-150}" \
                            --cases "${GC_CASES:-weak}" \
                            --out "$OUT/grouped-candidates-$d.json" 2>&1 | tee "$OUT/grouped-candidates-$d.txt" | tail -n 20
                        done ;;
    grouped-rules) python3 tools/grouped_rule_candidates.py --out "$OUT/grouped-rule-candidates.json" 2>&1 \
                     | tee "$OUT/grouped-rule-candidates.txt" | tail -n 40 ;;
    grouped-frag) python3 tools/grouped_frag_candidates.py --dtype bf16 --out "$OUT/grouped-frag-bf16.json" 2>&1 | tail -n 4
                  for d in fp16 bf16; do
                    python3 tools/grouped_frag_candidates.py --dtype $d --routing-seed "${FRAG_SEED:-61001}" \
                      --out "$OUT/grouped-frag-$d-heldout.json" 2>&1 | tail -n 4
                  done ;;
    functorch) pytest_ -m "" tests/core/test_functorch.py 2>&1 | tee "$OUT/functorch-tests.log" | tail -n 4 ;;
    grouped-gluon) pytest_ -m "" tests/grouped/test_grouped_gluon.py tests/grouped/test_grouped_gluon_gpu.py 2>&1 \
                     | tee "$OUT/grouped-gluon-tests.log" | tail -n 15 ;;
    moe-route) python3 tools/moe_route_probe.py --out "$OUT/moe-route-probe.json" 2>&1 | tail -n 10
               pytest_ -m "" tests/grouped/test_grouped_routing.py tests/grouped/test_grouped_act_order.py \
                 tests/models/test_models_moe_checkpoint.py 2>&1 | tee "$OUT/moe-route-tests.log" | tail -n 4 ;;
    grouped-host) python3 tools/grouped_host_probe.py 2>&1 | tee "$OUT/grouped-host.txt" | sed -n 1,24p
                  pytest_ -m gpu tests/grouped/test_grouped_replay_gpu.py 2>&1 | tee "$OUT/grouped-replay-tests.log" | tail -n 8 ;;
    conv2d-grouped) python3 tools/conv2d_grouped_candidates.py --budget "${CONV_BUDGET:-150}" \
                      --out "$OUT/conv2d-grouped-candidates.json" 2>&1 | tee "$OUT/conv2d-grouped-candidates.log" | tail -n 16
                    pytest_ -m gpu tests/conv2d/test_conv2d_grouped_packed.py 2>&1 | tee "$OUT/conv2d-grouped-tests.log" \
                      | tail -n 8 ;;
    conv2d-host) python3 tools/conv2d_host_probe.py 2>&1 | tee "$OUT/conv2d-host.txt" | sed -n 1,40p
                 pytest_ -m gpu tests/conv2d/test_conv2d_host_gpu.py tests/conv2d/test_conv2d_replay.py tests/nn/test_linear_conv.py \
                     2>&1 | tee "$OUT/conv2d-host-tests.log" | tail -n 8 ;;
    grouped-tests) pytest_ -m "" -n 8 tests/grouped 2>&1 | tee "$OUT/grouped-tests.log" | tail -n 15 ;;
    route) python3 tools/call_route.py --out "$OUT/route.json" 2>&1 | grep -v Warning | tail -n 16 ;;
    first-call) python3 tools/first_call.py --out "$OUT/first-call.json" 2>&1 | tail -n 20 ;;
    zoo) graph=(); sfx=; [ -n "${ZOO_GRAPH:-}" ] && graph=(--cuda-graph) && sfx=-graph
         for part in ${ZOO_PART:-0/8}; do for d in ${ZOO_DTYPES:-fp16}; do
           tag=${part/\//of}; name=conv2d-zoo-${ZOO_MODE:-fwd}-$d-${tag/:/-}$sfx
           bench --op conv2d --sweep "zoo:$part" --mode "${ZOO_MODE:-fwd}" --dtype $d --kernels auto \
             ${graph[@]+"${graph[@]}"} --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
           grep -E "^(--)?precompile" "$OUT/$name.log" | tail -n 2; tail -n 3 "$OUT/$name.log"; done; done ;;
    zoo-models) # without compile (a model's compile takes most of a minute): b32 eager and graph, b1 eager, b32 train
                for m in ${ZOO_MODELS:-resnext50_32x4d convnext_tiny efficientnet_b0 mobilenet_v3_large regnet_y_1_6gf}; do
                  timeout 90 python3 -m tilegemm.cli bench --quiet --no-save --op conv2d --model $m --dtype "${ZOO_DTYPE:-fp16}" \
                    --shape 32,eager --shape 32,graph --shape 1,eager --shape 32,train \
                    --json "$OUT/conv2d-model-$m.json" 2>&1 | grep -E "b32|b1 |geomean|auto  |wrong|error" | tail -n 12
                done ;;
    w4-fused) for m in llama qwen2; do
                bench --op w4a16 --model $m --kernels auto,fused --json "$OUT/w4a16-fused-$m.json" 2>&1 \
                  | grep -E "b1 |b16 |geomean|auto  |fused  |wrong|error" | tail -n 12
              done
              timeout -s INT "${MOE_TIMEOUT:-280}" python3 -m tilegemm.cli bench --quiet --no-save --op grouped_w4a16 \
                --model qwen3_moe --layers "${MOE_LAYERS:-24}" --shape 1,graph --shape 16,graph --shape 1,compile \
                --kernels auto,fused --json "$OUT/moe-w4-fused-qwen3.json" 2>&1 | grep -E "│ b|auto  |fused  |wrong|error" | tail -n 12
              pytest_ -m "" tests/nn/test_fuse_projections.py tests/nn/test_absorb_act_order.py tests/nn/test_fold_batchnorm.py \
                tests/nn/test_inference_transforms_gpu.py 2>&1 | tee "$OUT/fuse-tests.log" | tail -n 4 ;;
    fold-models) # convert_ against convert_(fold_batchnorm=True) (row fold): b32 eager and graph, b1 eager, fp16
                for m in ${ZOO_MODELS:-resnet50 resnext50_32x4d efficientnet_b0 mobilenet_v3_large regnet_y_1_6gf}; do
                  timeout 100 python3 -m tilegemm.cli bench --quiet --no-save --op conv2d --model $m --dtype "${ZOO_DTYPE:-fp16}" \
                    --shape 32,eager --shape 32,graph --shape 1,eager --kernels auto,fold \
                    --json "$OUT/conv2d-fold-$m.json" 2>&1 | grep -E "b32|b1 |geomean|auto  |fold  |wrong|error" | tail -n 12
                done ;;
    dw-wgrad)   # the depthwise and grouped_direct weight gradients' slice counts against cuDNN (research/)
                PYTHONPATH=src:tools timeout 200 python3 research/depthwise_wgrad_rows.py --per-kind 10 --budget 130 \
                  --candidates tap-2-8,tap-16-4,tap-32-2 \
                  --out "$OUT/depthwise-wgrad.json" 2>&1 | tail -n 11
                PYTHONPATH=src:tools timeout 120 python3 research/depthwise_wgrad_rows.py --kernel grouped_direct --budget 80 \
                  --out "$OUT/grouped-direct-wgrad.json" 2>&1 | tail -n 8 ;;
    dw-5x5)     PYTHONPATH=src:tools timeout 280 python3 research/depthwise_wgrad_rows.py --kinds 5x5 --per-kind 45 \
                  --budget 220 --dgrad \
                  --candidates walk-4-1,walk-4-1-r1,walk-4-1-r1-v1,walk-4-1-r1-v2,walk-2-1-r1,walk-8-1-r1 \
                  --out "$OUT/dw-5x5.json" 2>&1 | tail -n 8 ;;
    wide-steps) PYTHONPATH=src:tools timeout 280 python3 research/wide_steps.py --budget "${CONV_BUDGET:-150}" \
                  --out "$OUT/wide-steps.json" 2>&1 | tail -n 18
                PYTHONPATH=src:tools timeout 200 python3 research/wide_steps.py --dgrad --budget 100 \
                  --out "$OUT/wide-steps-dgrad.json" 2>&1 | tail -n 11
                pytest_ -m "" -n 8 -rf tests/conv2d/test_conv2d_padded.py 2>&1 | tee "$OUT/padded-tests.log" | tail -n 4 ;;
    tma-tiles)  PYTHONPATH=src:tools timeout 320 python3 research/tma_tiles.py --budget "${CONV_BUDGET:-200}" \
                  --out "$OUT/tma-tiles.json" 2>&1 | tail -n 20 ;;
    cublas-1x1) python3 tools/cublas_kernels.py --reps 20 --cases fp16:6272x192x1920:nt,fp16:7200x304x1056:nt,\
fp16:3200x1392x232:nt,fp16:6272x672x288:nt,fp16:3200x384x1392:nt,fp16:6272x192x1632:nt,fp16:6272x888x336:nt,\
fp16:6272x488x488:nt 2>&1 | tail -n 16 ;;
    narrow-1x1) PYTHONPATH=src:tools timeout 280 python3 research/narrow_1x1.py --budget "${CONV_BUDGET:-150}" \
                  --out "$OUT/narrow-1x1.json" 2>&1 | tail -n 14 ;;
    dw-cols)    PYTHONPATH=src:tools timeout 280 python3 research/depthwise_wgrad_rows.py --per-kind 10 --budget 220 \
                  --candidates walk-4-1-c1,walk-4-1-c2,walk-4-1-c4,walk-4-1-c8 --out "$OUT/dw-cols.json" 2>&1 | tail -n 11 ;;
    dw-cols-heldout)  # the column-runs rule on the zoo's layers it splits, but those it was fitted on
                PYTHONPATH=src:tools timeout 280 python3 research/depthwise_wgrad_rows.py --rule-cols --per-kind 100 \
                  --exclude benchmarks/results/2026-12-07-h100/92a09bdb/dw-cols.json.xz --budget 220 \
                  --candidates rule-c1,rule --out "$OUT/dw-cols-heldout.json" 2>&1 | tail -n 9 ;;
    dgrad-fwd)  # the stride-1 depthwise and grouped data gradients as forward convolutions against the direct kernels
                for d in ${DGRAD_DTYPES:-fp16}; do PYTHONPATH=src:tools timeout 300 python3 research/dgrad_as_forward.py \
                  --budget "${DGRAD_BUDGET:-150}" --dtype $d --out "$OUT/dgrad-as-forward-$d.json" 2>&1 \
                  | tee "$OUT/dgrad-as-forward-$d.log" | tail -n 9; done
                pytest_ -m gpu -n 4 -rf tests/conv2d/test_dgrad_as_forward.py tests/conv2d/test_conv2d_replay.py 2>&1 \
                  | tee "$OUT/dgrad-fwd-tests.log" | tail -n 4 ;;
    dgrad-strided)  # the strided depthwise and grouped data gradients by phase convolutions (research/)
                PYTHONPATH=src:tools timeout 300 python3 research/dgrad_as_forward.py --strided --budget "${DGRAD_BUDGET:-150}" \
                  --out "$OUT/dgrad-strided-fp16.json" 2>&1 | tee "$OUT/dgrad-strided-fp16.log" | tail -n 9 ;;
    conv2d-odd) for d in fp16 bf16; do
                  bench --op conv2d --sweep odd --dtype $d --kernels auto,implicit_gemm --json "$OUT/conv2d-odd-fwd-$d.json" 2>&1 | tail -n 12
                  bench --op conv2d --sweep odd --dtype $d --mode bwd --kernels auto --json "$OUT/conv2d-odd-bwd-$d.json" 2>&1 | tail -n 12
                done
                pytest_ -m gpu tests/conv2d/test_conv2d_padded.py tests/conv2d/test_tma_fwd.py 2>&1 | tee "$OUT/conv2d-odd-tests.log" | tail -n 15 ;;
    w4a16|conv2d) bench --op "$step" --json "$OUT/$step.json" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "=== done $(date +%T)"
