#!/usr/bin/env bash
# The GPU tests and the benchmarks on a CUDA machine, in one call from the repository root:
#
#   scripts/gpu_run.sh [STEP...]      STEP: tests w1 w2 w3 preempt profile w1-split dropin w4
#                                     beam tp-tests startup lm-eval serving moe moe-w1 moe-w2
#                                     moe-prof moe-kernels speculation quantized lora hybrid
#                                     hybrid-tests hybrid-bench dp (default: the first four)
#
# Everything printed also goes to $OUT/run.log, and this run's result JSONs, README-table.md and
# throughput.png are copied into $OUT, when OUT is set. Each step runs under a time limit (a
# benchmark cut short keeps the figures it had saved) and a failing step does not stop the next.
# A call runs at most 10 minutes: the GPU tests take 4 to 6 of them (their slowest are listed)
# and the w1 baselines about 5, so split the steps, e.g. `scripts/gpu_run.sh tests`, then
# `T_W1=480 scripts/gpu_run.sh w1`, then `BASELINES=reuse scripts/gpu_run.sh w2 w3`.
# Settings, from the environment:
#   BASELINES=1|0|reuse  measure the transformers baselines in w1 and w2, skip them, or reuse the
#                        figures of the result JSON already in $RESULTS for this workload and device
#   SHAPE=0.6b CKPT=/tmp/ckpt/0.6b   the random bf16 checkpoint, built once
#   RESULTS=benchmarks/results       where the benchmarks write their JSON
#   BENCH_GIT_COMMIT=<hash>   the commit the result JSONs name (default: git's HEAD, with
#                        +modified for a tree that differs from it)
#   T_EACH=150           the limit of one test (with pytest-timeout installed)
#   T_TESTS=420 T_W1=270 T_W2=150 T_W3=60 T_PRE=240 T_PROF=120 T_BEAM=240   time limits of the
#                        steps (s)
#   T_DROPIN_TESTS=240 T_DROPIN=420   the drop-in GPU tests (three script runs in subprocesses) and
#                        the drop-in benchmark (the stock script's generate alone takes minutes)
#   REPEATS=3            repeats of each w2 latency measurement
#   BENCH_ARGS=...       more arguments for every benchmark, e.g. "-E max_num_seqs=128"
#   W1_ARGS W2_ARGS W3_ARGS BEAM_ARGS=...   more arguments for one benchmark, e.g.
#                        W1_ARGS="--baselines cb"
#   PRE_ARGS="--num-requests 64 --num-kv-blocks 250"   the preemption check (float32: slow)
#   W4: the 8B shape (CKPT8B=/tmp/ckpt/8b, built once, drawn on the GPU) with
#       tensor_parallel_size 1, 2 and 4 (TP_SIZES="1 2 4"; sizes above the GPU count are
#       skipped): W1 without baselines (T_W4=900), batch-1 decode and TTFT (T_W4B=300), and a
#       step profile per size with its NCCL time (T_W4P=150 each; W4_PROFILE_SIZES, default
#       TP_SIZES). On several GPUs:
#       scripts/gpu_run.sh tp-tests w4
#       W4_SHAPE=32b runs it on another shape of make_checkpoint's (/tmp/ckpt/<shape>, results
#       tagged with the shape: w4-32b-<device>.json); the 32B shape, 64 GB in bf16, is drawn on
#       one GPU (its build a step: T_W4_CKPT=600) and needs the disk of a machine of several:
#       W4_SHAPE=32b TP_SIZES="2 4"
#   tp-tests: the tensor-parallel GPU tests and the CPU (gloo) ones; T_TP=400
#   dp: W1 with data_parallel_size 1, 2 and 4 in one run (DP_SIZES; sizes above the GPU count
#       are skipped), each size's scaling over size 1 in the result (w1-dp-<device>.json), no
#       baselines; T_DP=420, DP_ARGS. On several GPUs: scripts/gpu_run.sh dp
#   w1-split: W1 at Qwen3's settings stepped by hand, its time per step group (prefill, decode
#       by batch size) against each group's floor (benchmarks.w1_split); T_SPLIT=120
#   startup: from_pretrained on an empty Triton cache, then warm (bench_startup); T_START=240
#   lm-eval: lm-eval's generate_until through HFLM, stock against patched (bench_lm_eval; needs
#       lm_eval importable, e.g. from wheels on PYTHONPATH); T_LMEVAL=420, LMEVAL_ARGS
#   serving: W1's 256 requests through hf-paged serve and transformers serve, both with
#       --continuous-batching: Poisson arrivals, then closed loops of 64 and 256 clients, each
#       phase bounded in time (bench_serving; needs fastapi, uvicorn, openai,
#       prometheus_client); T_SERVE=560, SERVE_ARGS (default: its own, about 7 minutes; on an
#       H100 "--rates 32 --concurrency 64 256 --client-processes 8 --systems
#       hf_paged_engine_process hf_paged" took 4; stock transformers serve on W1's first
#       requests, cut short, beside them: "--baseline-requests 1 4 16 --baseline-max-output 128
#       --baseline-phase-timeout 60")
#   moe: Qwen3-30B-A3B's layers, MOE_LAYERS=24 of its 48 (30 GB in bf16: a 64 GiB disk holds
#       it), built once at CKPT_MOE=/tmp/ckpt/30b-a3b-$MOE_LAYERS (drawn on the GPU, written
#       aside and moved in whole, so a build cut short leaves none; 69 s on an H100,
#       T_MOE_CKPT=150), then W1 at temperature 0.6, hf_paged's main line and the baselines per
#       BASELINES (T_MOE_W1=240; MOE_W1_ARGS, e.g. "--extra-lines qwen3_sampling" for the
#       Qwen3-settings line, an engine start and a W1 run more), batch-1 decode and TTFT
#       (T_MOE_W2=120; MOE_W2_ARGS) and the step profile into profile-$MOE_TAG
#       (T_MOE_PROF=100): about 9 minutes, the build included. The results are tagged
#       MOE_TAG=30b-a3b-${MOE_LAYERS}l (w1-$MOE_TAG-<device>.json). moe-w1, moe-w2 and moe-prof
#       run one of them (the checkpoint built if missing). The baselines will not fit those limits
#       (transformers' generate takes 76 ms a step at batch 64 and 58 at batch 1 on an H100,
#       W1's 64 baseline requests about 1,000 steps): once the checkpoint is built, measure
#       them in calls of their own, `T_MOE_W1=500 scripts/gpu_run.sh moe-w1`, then
#       `T_MOE_W2=400 scripts/gpu_run.sh moe-w2 moe-prof`, and later calls
#       `BASELINES=reuse scripts/gpu_run.sh moe`
#   moe-kernels: the MoE kernels on their own (benchmarks.bench_moe); T_MOE_K=120
#   fp8-kernels: the FP8 projections on their own (benchmarks.bench_fp8_linear); T_FP8_K=150
#   quantized: W8 (benchmarks.bench_quantized) on each of QUANT_SHAPES (default 0.6b; also 8b
#       at CKPT8B, 30b-a3b at the moe step's checkpoint, each built if missing): the
#       checkpoint's FP8 copy built once beside it (<checkpoint>-fp8, T_QUANT_CKPT=240), then
#       W1 and batch-1 decode on both against their floors with transformers' FP8 generate as
#       the baseline, and on 0.6b W1 with kv_cache_dtype="fp8" and the two caches' agreement
#       (T_QUANT=420 a shape; QUANT_ARGS). On an H100 an estimated 3 minutes for 0.6b, 3 for 8b
#       and 4 for 30b-a3b (24 layers) plus its copy: one shape a call, the larger ones with
#       BASELINES=0 if the call is short (30b-a3b: stock's FP8 MoE generate did not finish 8 of
#       W1's requests in 5 minutes; QUANT_ARGS="--baseline-max-output-len 64" caps them). The
#       8b and 30b-a3b checkpoints and their copies (24 + 45 GB) do not fit one 64 GiB disk
#       together: one of them a machine
#       STOCK_FP8_KERNEL=PATH: a local copy of the hub package kernels-community/finegrained-fp8
#       for transformers' FP8 baseline on a machine without the hub (benchmarks.stock_fp8_kernel)
#   speculation: W6 (benchmarks.bench_speculation): an 8B target and three 0.6B drafts of known
#       acceptance (they follow a token permutation; 16 + 3 x 1.5 GB in bf16, W4's random 8B
#       cannot serve), built once under SPEC_CKPTS=/tmp/ckpt/speculation (drawn on the GPU,
#       each written aside and moved in whole; about a minute), then batch-1 decode plain, with
#       each draft, with the target as its own draft and with prompt lookup, transformers'
#       plain, assisted and prompt-lookup generation per BASELINES (64 new tokens: stock
#       decoding is slow), and W1 on $CKPT with and without speculative_method="ngram": an
#       estimated 4 to 5 minutes with the build, 3 to 4 without; T_SPEC=480, SPEC_ARGS (e.g.
#       "--skip-w1 --skip-self-draft")
#   lora: the LoRA GPU tests (tests/gpu/test_lora_gpu.py, not in the tests step: bf16 parity
#       with transformers + peft on a mixed-adapter batch, the kernels at real shapes;
#       T_LORA_TESTS=240), then W9 (benchmarks.bench_lora) on $CKPT: 16 random rank-16
#       adapters saved by peft, W1 on the base model and with 1, 4 and 16 adapters against the
#       base and their floors, batch-1 decode without and with one, transformers + peft
#       generate as the baseline per BASELINES (T_LORA=480; LORA_ARGS). On an H100 an
#       estimated 1-2 minutes for the tests and 4-5 for the benchmark with its baselines
#       (about 3 with BASELINES=reuse); results tagged with $SHAPE (lora-0.6b-<device>.json)
#   hybrid: the hybrid GPU tests (tests/gpu/test_hybrid_gpu.py, not in the tests step: bf16
#       parity with transformers on four layers of the Qwen3.5-9B and Qwen3.5-35B-A3B shapes,
#       graphs over reused state slots, snapshot hits, the Gated DeltaNet kernels at real head
#       sizes; T_HYBRID_TESTS=300), then bench_hybrid on each of HYBRID_SHAPES (default
#       "qwen3.5-9b qwen3.5-35b-a3b"): the checkpoint built once under
#       HYBRID_CKPTS=/tmp/ckpt as <shape>-<layers>l (drawn on the GPU, written aside and moved in
#       whole; T_HYBRID_CKPT=180), all 32 layers of the 9B (HYBRID_9B_LAYERS; 18 GB) and 16 of
#       the 35B-A3B's 40 (HYBRID_MOE_LAYERS; 29 GB: its 40, 69 GB, fit no 64 GiB disk; keep a
#       multiple of 4, the 3:1 layer pattern), each layer of its real shape; then W1 and
#       batch-1 decode against their floors (weights, full-attention KV, each sequence's
#       linear-layer state read and written a step) and stock generate on W1's first 16
#       requests cut to 128 new tokens and at batch 1 (64 tokens), and W3 with prefix caching
#       on (num_state_snapshots=64) and off (T_HYBRID=420 a shape; HYBRID_ARGS). Results tagged
#       <shape>-<layers>l (hybrid-qwen3.5-9b-32l-<device>.json). hybrid-tests and hybrid-bench
#       run one half. On an H100: the tests 1.5 minutes; the 9B shape 40 s to build and 4.3
#       minutes with its baselines (2 with BASELINES=reuse), the 35B-A3B shape 50 s and 2.5
#       minutes (1.8 reused): `scripts/gpu_run.sh hybrid-tests`, one shape a call with its
#       baselines, later both in one, `BASELINES=reuse HYBRID_SHAPES="qwen3.5-9b
#       qwen3.5-35b-a3b" scripts/gpu_run.sh hybrid-bench` (the two checkpoints, 47 GB, fit a
#       64 GiB disk together)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1

SHAPE=${SHAPE:-0.6b}
CKPT=${CKPT:-/tmp/ckpt/$SHAPE}
RESULTS=${RESULTS:-benchmarks/results}
BASELINES=${BASELINES:-1}
case $BASELINES in
  1) BASELINE_ARGS=() ;;
  0) BASELINE_ARGS=(--baselines) ;;
  reuse) BASELINE_ARGS=(--reuse-baselines auto) ;;
  *) echo "BASELINES must be 1, 0 or reuse, got $BASELINES" >&2; exit 2 ;;
esac
# A hung test fails alone, with every thread's stack, instead of eating its step's limit.
EACH_TEST=()
if python -c "import pytest_timeout" 2>/dev/null; then
  EACH_TEST=(--timeout "${T_EACH:-150}")
fi
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=(tests w1 w2 w3)
STATUS=()

step() {  # step NAME LIMIT COMMAND...: run COMMAND under a time limit, record how it ended
  local name=$1 limit=$2 start=$SECONDS rc=0
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=20 "$limit" "$@" || rc=$?
  # A step cut short can leave tensor-parallel ranks behind, spinning on the GPUs.
  pkill -9 -f "[h]f_paged.worker.follower|[t]ests.parallel.run_engine" || true
  local how="ok"
  [[ $rc -eq 0 ]] || how="exit $rc"
  [[ $rc -ne 124 ]] || how="timed out"
  STATUS+=("$(printf '%-6s %-10s %4ss' "$name" "$how" $((SECONDS - start)))")
  LAST_RC=$rc
}

bench() {  # bench NAME LIMIT MODULE EXTRA_ARGS ARGS...: one benchmark as a step
  local name=$1 limit=$2 module=$3 extra
  read -r -a extra <<< "${BENCH_ARGS:-} $4"
  shift 4
  step "$name" "$limit" python -m "benchmarks.$module" --model "$CKPT" --results-dir "$RESULTS" \
    "${extra[@]}" "$@"
}

moe() {  # moe PART...: the 30B-A3B checkpoint, built once, and its PARTs (w1 w2 prof)
  local layers=${MOE_LAYERS:-24} part
  local ckpt=${CKPT_MOE:-/tmp/ckpt/30b-a3b-$layers} tag=${MOE_TAG:-30b-a3b-${layers}l}
  if [[ ! -d $ckpt ]]; then
    rm -rf "$ckpt.partial"
    step moe-ckpt "${T_MOE_CKPT:-150}" python -m benchmarks.make_checkpoint --shape 30b-a3b \
      --layers "$layers" --out "$ckpt.partial" --dtype bfloat16
    [[ $LAST_RC -ne 0 ]] || mv "$ckpt.partial" "$ckpt"
  fi
  [[ -d $ckpt ]] || return 0  # the build failed: its step says so
  for part in "$@"; do
    case $part in
      # W1's main line only (--extra-lines): each line is an engine start and a W1 run more.
      w1) CKPT=$ckpt bench moe-w1 "${T_MOE_W1:-240}" bench_throughput \
            "--extra-lines ${MOE_W1_ARGS:-}" --tag "$tag" "${BASELINE_ARGS[@]}" ;;
      w2) CKPT=$ckpt bench moe-w2 "${T_MOE_W2:-120}" bench_latency "${MOE_W2_ARGS:-}" \
            --tag "$tag" "${BASELINE_ARGS[@]}" --repeats "${REPEATS:-3}" ;;
      prof) step moe-prof "${T_MOE_PROF:-100}" python -m benchmarks.profile_steps \
            --model "$ckpt" --results-dir "$RESULTS" --name "profile-$tag" ;;
    esac
  done
}

quantized() {  # W8 on each shape of QUANT_SHAPES, its FP8 copy built once
  local shape ckpt parts tag
  for shape in ${QUANT_SHAPES:-0.6b}; do
    tag=$shape
    case $shape in
      0.6b) ckpt=$CKPT parts="w1 batch1 kv" ;;
      8b) ckpt=${CKPT8B:-/tmp/ckpt/8b} parts="w1 batch1"
          python -m benchmarks.make_checkpoint --shape 8b --out "$ckpt" --dtype bfloat16 ;;
      30b-a3b) ckpt=${CKPT_MOE:-/tmp/ckpt/30b-a3b-${MOE_LAYERS:-24}} parts="w1 batch1"
          tag=$shape-${MOE_LAYERS:-24}l
          moe ;;  # no part: only the checkpoint
      *) echo "QUANT_SHAPES: unknown shape $shape (0.6b 8b 30b-a3b)"; STATUS+=("quant-$shape unknown")
         continue ;;
    esac
    [[ -d $ckpt ]] || continue
    if [[ ! -d $ckpt-fp8 ]]; then
      rm -rf "$ckpt-fp8.partial"
      step "quant-ckpt-$shape" "${T_QUANT_CKPT:-240}" python -m benchmarks.fp8_checkpoint \
        --source "$ckpt" --out "$ckpt-fp8.partial"
      [[ $LAST_RC -ne 0 ]] || mv "$ckpt-fp8.partial" "$ckpt-fp8"
    fi
    [[ -d $ckpt-fp8 ]] || continue
    # shellcheck disable=SC2086  # parts and QUANT_ARGS are word lists
    CKPT=$ckpt bench "quant-$shape" "${T_QUANT:-420}" bench_quantized "${QUANT_ARGS:-}" \
      --fp8-model "$ckpt-fp8" --parts $parts --tag "$tag" "${BASELINE_ARGS[@]}" \
      ${STOCK_FP8_KERNEL:+--stock-fp8-kernel "$STOCK_FP8_KERNEL"}
  done
}

hybrid() {  # hybrid PART...: the hybrid GPU tests (tests) and bench_hybrid on HYBRID_SHAPES (bench)
  local part shape layers ckpt
  for part in "$@"; do
    if [[ $part == tests ]]; then
      step hybrid-tests "${T_HYBRID_TESTS:-300}" python -m pytest tests/gpu/test_hybrid_gpu.py -q \
        --durations=8 "${EACH_TEST[@]}"
      continue
    fi
    for shape in ${HYBRID_SHAPES:-qwen3.5-9b qwen3.5-35b-a3b}; do
      case $shape in
        qwen3.5-9b) layers=${HYBRID_9B_LAYERS:-32} ;;
        qwen3.5-35b-a3b) layers=${HYBRID_MOE_LAYERS:-16} ;;
        *) echo "HYBRID_SHAPES: unknown shape $shape (qwen3.5-9b qwen3.5-35b-a3b)"
           STATUS+=("hybrid-$shape unknown"); continue ;;
      esac
      ckpt=${HYBRID_CKPTS:-/tmp/ckpt}/$shape-${layers}l
      if [[ ! -d $ckpt ]]; then
        rm -rf "$ckpt.partial"
        step "hybrid-ckpt-$shape" "${T_HYBRID_CKPT:-180}" python -m benchmarks.make_checkpoint \
          --shape "$shape" --layers "$layers" --out "$ckpt.partial" --dtype bfloat16
        [[ $LAST_RC -ne 0 ]] || mv "$ckpt.partial" "$ckpt"
      fi
      [[ -d $ckpt ]] || continue  # the build failed: its step says so
      CKPT=$ckpt bench "hybrid-$shape" "${T_HYBRID:-420}" bench_hybrid "${HYBRID_ARGS:-}" \
        --tag "$shape-${layers}l" "${BASELINE_ARGS[@]}"
    done
  done
}

STARTED=$(mktemp)  # the JSONs written after it are this run's

main() {
  nvidia-smi -L || true
  python -c 'import sys, torch, transformers, triton
print("python", sys.version.split()[0], "| torch", torch.__version__, "| transformers",
      transformers.__version__, "| triton", triton.__version__, "| cuda", torch.cuda.is_available())' \
    || true
  python -m benchmarks.make_checkpoint --shape "$SHAPE" --out "$CKPT" --dtype bfloat16

  for s in "${STEPS[@]}"; do
    case $s in
      tests) step tests "${T_TESTS:-420}" python -m pytest tests/gpu tests/kernels -m gpu -q \
            --ignore tests/gpu/test_dropin_gpu.py --ignore tests/gpu/test_lora_gpu.py \
            --ignore tests/gpu/test_hybrid_gpu.py \
            --durations=12 "${EACH_TEST[@]}" ;;
      w1) bench w1 "${T_W1:-270}" bench_throughput "${W1_ARGS:-}" "${BASELINE_ARGS[@]}" ;;
      # shellcheck disable=SC2086  # DP_SIZES is a word list
      dp) bench dp "${T_DP:-420}" bench_throughput "${DP_ARGS:-}" --tag dp --extra-lines \
            --baselines --data-parallel-size ${DP_SIZES:-1 2 4} ;;
      w2) bench w2 "${T_W2:-150}" bench_latency "${W2_ARGS:-}" "${BASELINE_ARGS[@]}" \
            --repeats "${REPEATS:-3}" ;;
      w3) bench w3 "${T_W3:-60}" bench_throughput "${W3_ARGS:-}" --workload w3 --baselines ;;
      preempt) step preempt "${T_PRE:-240}" python -m benchmarks.check_preemption \
            --model "$CKPT" --results-dir "$RESULTS" ${PRE_ARGS:---num-requests 64 --num-kv-blocks 250} ;;
      beam) bench beam "${T_BEAM:-240}" bench_beam_search "${BEAM_ARGS:-}" "${BASELINE_ARGS[@]}" ;;
      startup) bench startup "${T_START:-240}" bench_startup "" ;;
      serving) step serving "${T_SERVE:-560}" python -m benchmarks.bench_serving --model "$CKPT" \
            --results-dir "$RESULTS" ${SERVE_ARGS:-} ;;
      lm-eval) step lm-eval "${T_LMEVAL:-420}" python -m benchmarks.bench_lm_eval --model "$CKPT" \
            --results-dir "$RESULTS" ${LMEVAL_ARGS:-} ;;
      profile) step profile "${T_PROF:-120}" python -m benchmarks.profile_steps \
            --model "$CKPT" --results-dir "$RESULTS" ;;
      w1-split) step w1-split "${T_SPLIT:-120}" python -m benchmarks.w1_split \
            --model "$CKPT" --results-dir "$RESULTS" ;;
      dropin)
        step dropin-tests "${T_DROPIN_TESTS:-240}" python -m pytest tests/gpu/test_dropin_gpu.py -q \
            "${EACH_TEST[@]}"
        step dropin "${T_DROPIN:-420}" python -m benchmarks.bench_dropin --model "$CKPT" \
            --results-dir "$RESULTS" ;;
      tp-tests) step tp-tests "${T_TP:-400}" python -m pytest -q "${EACH_TEST[@]}" \
            tests/gpu/test_tensor_parallel_gpu.py tests/gpu/test_gpu_parity.py \
            -k "tp_bf16 or dp2_bf16 or not gpu_parity" \
            tests/parallel ;;
      w4) local shape=${W4_SHAPE:-8b} sizes tag=() name=w4
          local ckpt=/tmp/ckpt/$shape
          if [[ $shape == 8b ]]; then ckpt=${CKPT8B:-$ckpt}; else tag=(--tag "$shape"); name=w4-$shape; fi
          read -r -a sizes <<< "${TP_SIZES:-1 2 4}"
          if [[ ! -d $ckpt ]]; then  # built aside and moved in whole: a cut build leaves none
            rm -rf "$ckpt.partial"
            step "$name-ckpt" "${T_W4_CKPT:-600}" python -m benchmarks.make_checkpoint \
              --shape "$shape" --out "$ckpt.partial" --dtype bfloat16
            [[ $LAST_RC -ne 0 ]] || mv "$ckpt.partial" "$ckpt"
          fi
          CKPT=$ckpt bench "$name" "${T_W4:-900}" bench_throughput "${W4_ARGS:-}" \
            --workload w4 "${tag[@]}" --baselines --tensor-parallel-size "${sizes[@]}"
          CKPT=$ckpt bench "$name-batch1" "${T_W4B:-300}" bench_latency "" --baselines \
            --workload w4 "${tag[@]}" --tensor-parallel-size "${sizes[@]}"
          read -r -a sizes <<< "${W4_PROFILE_SIZES:-${sizes[*]}}"
          for n in "${sizes[@]}"; do
            [[ $n -le $(nvidia-smi -L | wc -l) ]] || continue
            step "$name-prof$n" "${T_W4P:-150}" python -m benchmarks.profile_steps --model "$ckpt" \
              --results-dir "$RESULTS" --tensor-parallel-size "$n" --name "$name-profile-tp$n"
          done ;;
      moe) moe w1 w2 prof ;;
      moe-w1|moe-w2|moe-prof) moe "${s#moe-}" ;;
      moe-kernels) step moe-kernels "${T_MOE_K:-120}" python -m benchmarks.bench_moe \
            --results-dir "$RESULTS" ;;
      fp8-kernels) step fp8-kernels "${T_FP8_K:-150}" python -m benchmarks.bench_fp8_linear \
            --results-dir "$RESULTS" ;;
      speculation) bench speculation "${T_SPEC:-480}" bench_speculation "${SPEC_ARGS:-}" \
            --checkpoints "${SPEC_CKPTS:-/tmp/ckpt/speculation}" "${BASELINE_ARGS[@]}" ;;
      quantized) quantized ;;
      lora)
        step lora-tests "${T_LORA_TESTS:-240}" python -m pytest tests/gpu/test_lora_gpu.py -q \
            --durations=5 "${EACH_TEST[@]}"
        bench lora "${T_LORA:-480}" bench_lora "${LORA_ARGS:-}" --tag "$SHAPE" \
            "${BASELINE_ARGS[@]}" ;;
      hybrid) hybrid tests bench ;;
      hybrid-tests|hybrid-bench) hybrid "${s#hybrid-}" ;;
      *) echo "unknown step $s (steps: tests w1 w2 w3 preempt profile w1-split dropin w4 beam tp-tests" \
              "startup lm-eval serving moe moe-w1 moe-w2 moe-prof moe-kernels fp8-kernels speculation"\
              "quantized lora hybrid hybrid-tests hybrid-bench dp)"
         STATUS+=("$s unknown") ;;
    esac
  done

  echo "=== results"
  if python -m benchmarks.report --results-dir "$RESULTS" && [[ -n ${OUT:-} ]]; then
    # Only this run's JSONs: a call brings back a bounded number of files.
    cp "$RESULTS/README-table.md" "$OUT/"
    find "$RESULTS" -name '*.json' -newer "$STARTED" -exec cp {} "$OUT/" \;
    [[ ! -f $RESULTS/throughput.png ]] || cp "$RESULTS/throughput.png" "$OUT/"
  fi
  echo "=== steps"
  printf '%s\n' "${STATUS[@]}"
}

if [[ -n ${OUT:-} ]]; then
  main 2>&1 | tee -a "$OUT/run.log"
else
  main
fi
