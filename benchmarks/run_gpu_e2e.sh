#!/usr/bin/env bash
# The GPU work (tests, benchmarks) on the GPU host, one step per call, from the repo root:
#
#   bash benchmarks/run_gpu_e2e.sh stage                 # bundle + package only (check it imports)
#   bash benchmarks/run_gpu_e2e.sh kernels [args]        # gpu-marked kernel tests, then
#        python -m benchmarks.kernels [args] (e.g. --shapes 2: SmolLM2's 9/3/64; --quick --append)
#   bash benchmarks/run_gpu_e2e.sh kbench [args]         # python -m benchmarks.kernels alone: the
#        full matrix does not fit one call (--quick alone took ~170 s on the H200), so one shape
#        per call, --shapes N --append; it saves its JSON after every row, so a call cut short by its
#        time limit keeps the rows it timed
#   bash benchmarks/run_gpu_e2e.sh tests [pytest args]   # tests/e2e but TP=2, gpu-marked: over one
#        10-minute call on an H200; split it in three: -k "tiny or smollm2", -k "prefix or
#        cuda_graphs", -k preempt (~4 min) ("not preempt" in one call ran past 9 min). With
#        INT8KV_E2E_WORKDIR=/tmp/e2e-work, a later call on the same host reuses every engine an
#        earlier one finished (same spec), so tests/e2e/test_gemma3_e2e.py (about nine engines)
#        spreads over calls; each greedy judgement lands in $OUT/logs/e2e_comparisons.jsonl as it
#        is made. The step waits for any other process on the GPU to exit before it starts.
#   bash benchmarks/run_gpu_e2e.sh alltests [args]       # every gpu-marked test in tests/
#   bash benchmarks/run_gpu_e2e.sh accuracy [args]       # python -m benchmarks.accuracy (~4-6 min)
#   bash benchmarks/run_gpu_e2e.sh throughput [args]     # python -m benchmarks.throughput (split it:
#        --configs auto_fa2,auto_triton  then  --configs int8_per_token_head,int8 --append).
#        1K rows are host-bound and moved 1.67x between identical runs: time them as
#        --configs auto_fa2 --ctx 1024 --repeats 2 --step-stats (~310 s on a fresh host), then
#        --configs int8 ... --repeats 3 (~200 s), then pool the calls' logs on this side with
#        python -m benchmarks.throughput --rows-from-log LOGS --pool --gpu "NVIDIA H200" --out FILE.
#        A host once changed speed 1.7x within a call (host_probe_ms 8 vs 14-18), so the 1K
#        ratio is now taken in one call with both engines resident and their runs alternating:
#        --configs auto_fa2,int8 --ctx 1024 --paired --repeats 3 --gpu-memory-utilization 0.45
#        --step-stats (280 s with --repeats 3 right after a --repeats 1 call, which
#        took 407 s on a fresh host, staging and the first engine's compile included)
#
# The reliability steps:
#
#   bash benchmarks/run_gpu_e2e.sh soak [args] [-- vllm serve args]   # python -m benchmarks.soak (~4-6 min)
#   bash benchmarks/run_gpu_e2e.sh longctx [args]        # python -m benchmarks.long_context (~5-8 min)
#   bash benchmarks/run_gpu_e2e.sh tp2 [pytest args]     # tests/e2e/test_tp2.py, needs 2 GPUs (~5 min)
#
# Serving numbers (vllm serve + vllm bench serve -> benchmarks/results/serving.json):
#
#   bash benchmarks/run_gpu_e2e.sh serve [args]          # python -m benchmarks.serve_bench: one
#        model per call, --time-budget-s under the call's limit, --append after the first call.
#        vLLM keys its compile cache, Triton's kernels included, on the engine's configuration:
#        keep --input-lens (so --max-model-len) the same over a host's calls, or every start
#        compiles again. Four servers started together on a 16-core H200 host took 196-306 s
#        each, int4's with about two minutes of the shim's kernel compiles (2026-12-06)
#
#   bash benchmarks/run_gpu_e2e.sh fa2precompile [args] # python -m benchmarks.fa2_precompile: the
#        FlashAttention-2 variants of SmolLM2 and Gemma 3, PTX-compiled once per fresh H200 host
#        (150 s with 16 at a time, 2026-12-02), before any timed BF16 run
#
#   bash benchmarks/run_gpu_e2e.sh warmup [args]        # python -m benchmarks.warmup_compile: the
#        start-up warm-up one compile at a time against N at a time, each row a fresh process
#        (--models gemma3 --dtypes int4 --threads 1,16: the slowest warm-up measured, about two
#        minutes one at a time with four servers starting together)
#
#   bash benchmarks/run_gpu_e2e.sh pack                  # $OUT -> $OUT/out.tgz (the device tool
#        returns at most 8 files: end every call with this)
#
# Stamps: INT8KV_GIT_COMMIT=<40-digit hash> names the commit the tree is in every result file
# (benchmarks/common.py git_commit): the host's copy of the tree can carry the git metadata of an
# older checkout and would stamp that commit, dirty.
#
# Assumes the offline vLLM bundle (shared/gpu/README.md) has been staged on this host by earlier
# calls, or that this call carries its parts. Logs and results go to $OUT (the device tool's output
# folder; /tmp/int8kv-out otherwise).
set -uo pipefail
step=${1:-}; shift || true
case "$step" in stage|kernels|kbench|tests|alltests|accuracy|throughput|soak|longctx|tp2|serve|fa2precompile|warmup) ;;
  pack)
    OUT=${OUT:-/tmp/int8kv-out}
    tar czf /tmp/int8kv-out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/int8kv-out.tgz "$OUT/out.tgz"
    exit $? ;;
  *) echo "usage: $0 stage|kernels|kbench|tests|alltests|accuracy|throughput|soak|longctx|tp2|serve|fa2precompile|warmup|pack [args]"; exit 2 ;;
esac
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/int8kv-out}; export OUT
# FlashAttention-2's PTX, compiled by the driver on an H200 (fa2_precompile.py), outgrows the
# compute cache's 256 MiB default
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
mkdir -p "$OUT/logs"

# shellcheck disable=SC1090,SC1091
source .gpu/p*/stage.sh 2>/dev/null || source /tmp/gpu-bundle/stage.sh
if [ -z "${SMOLLM2_DIR:-}" ]; then
  echo "run_gpu_e2e: the vLLM bundle is not ready on this host (see above)"; exit 3
fi

# The package as a user would have it: `int8kv_kernels` (repo folder kernels/), `int8kv_shim`, and
# the `vllm.general_plugins` entry point that vLLM loads in every process, engine core included.
# Preferred: an editable install. Fallback: a site folder on PYTHONPATH with symlinks and a
# hand-written dist-info (importlib.metadata finds entry points in any sys.path folder).
if ! python3 -c "import int8kv_shim, int8kv_kernels" 2>/dev/null; then
  if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/logs/pip.log" 2>&1 \
     || ! python3 -c "import int8kv_shim, int8kv_kernels" 2>/dev/null; then
    echo "run_gpu_e2e: editable install failed (tail of $OUT/logs/pip.log below); using a site dir"
    tail -3 "$OUT/logs/pip.log"
    SITE=/tmp/int8kv-site; rm -rf "$SITE"; mkdir -p "$SITE/int8kv_shim-0.0.0.dist-info"
    ln -s "$REPO/kernels" "$SITE/int8kv_kernels"; ln -s "$REPO/int8kv_shim" "$SITE/int8kv_shim"
    printf 'Metadata-Version: 2.1\nName: int8kv-shim\nVersion: 0.0.0\n' \
      > "$SITE/int8kv_shim-0.0.0.dist-info/METADATA"
    printf '[vllm.general_plugins]\nint8kv_shim = int8kv_shim.plugin:register\n' \
      > "$SITE/int8kv_shim-0.0.0.dist-info/entry_points.txt"
    export PYTHONPATH="$SITE:$PYTHONPATH"
    # without the entry point working, a sitecustomize imports the shim in every process
    [ -f sitecustomize_example/sitecustomize.py ] && export PYTHONPATH="$REPO/sitecustomize_example:$PYTHONPATH"
  fi
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, vllm, int8kv_shim; print(sys.version.split()[0], 'torch', torch.__version__, 'vllm', vllm.__version__, 'shim', int8kv_shim.__file__)"
  python3 -c "from importlib.metadata import entry_points as e; print('plugins:', [x.value for x in e(group='vllm.general_plugins')])"
} 2>&1 | tee "$OUT/logs/env.log"

# An engine left over from an earlier, killed call makes vLLM's memory profiling fail ("Initial free
# memory ... current free memory ...") when it exits mid-profile. Say so; INT8KV_KILL_STALE=1 kills
# leftover engine cores first (on a dedicated GPU host only).
# (Not this script's own callers: a calling shell whose command line names EngineCore, e.g. in a
# grep of the output, matches too and was killed with it.)
ancestors=" "; pid=$$
while [ -n "$pid" ] && [ "$pid" -gt 1 ]; do ancestors+="$pid "; pid=$(ps -o ppid= -p "$pid" | tr -d ' '); done
stale=$(for pid in $(pgrep -f "[E]ngineCore|[V]LLM::"); do
  case "$ancestors" in *" $pid "*) ;; *) echo "$pid" ;; esac
done)
if [ -n "$stale" ]; then
  if [ "${INT8KV_KILL_STALE:-0}" = 1 ]; then
    # shellcheck disable=SC2086  # one word per PID
    echo "run_gpu_e2e: killing leftover vLLM processes: $stale"; kill -9 $stale; sleep 3
  else
    echo "run_gpu_e2e: WARNING leftover vLLM processes (set INT8KV_KILL_STALE=1 to kill): $stale"
  fi
fi
# An engine killed by an earlier call's timeout can hold its GPU memory for a while as it exits
# (the next engine once found 68 of 140 GiB free and refused to start). Give GPU
# processes that are not ours up to 90 s to go.
for i in $(seq 90); do
  apps=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
  [ -z "$apps" ] && break
  [ "$i" = 1 ] && echo "run_gpu_e2e: waiting for GPU processes to exit: $(echo $apps)"
  sleep 1
done
run() { echo "+ $*"; "$@" 2>&1 | tee "$OUT/logs/$step.log"; return "${PIPESTATUS[0]}"; }
# what this call writes under benchmarks/results is copied to $OUT at the end (see there)
started="$OUT/logs/.call_started"; touch "$started"
case "$step" in
  stage) rc=0 ;;
  kernels) run python3 -m pytest tests/kernels -m gpu -q -rfE; rc=$?
           python3 -m benchmarks.kernels "$@" 2>&1 | tee "$OUT/logs/kernels_bench.log"
           rc=$(( rc || PIPESTATUS[0] )) ;;
  kbench) python3 -m benchmarks.kernels "$@" 2>&1 | tee "$OUT/logs/kernels_bench.log"
          rc=${PIPESTATUS[0]} ;;
  # TP=2 has its own step: on a 2-GPU host it would otherwise run here too (~4 more minutes)
  tests) run python3 -m pytest tests/e2e -m gpu -v -rA -s --ignore=tests/e2e/test_tp2.py "$@"
         rc=$? ;;
  alltests) run python3 -m pytest tests -m gpu -v -rA "$@"; rc=$? ;;
  accuracy) run python3 -m benchmarks.accuracy "$@"; rc=$? ;;
  throughput) run python3 -m benchmarks.throughput "$@"; rc=$? ;;
  soak) run python3 -m benchmarks.soak "$@"; rc=$? ;;
  serve) run python3 -m benchmarks.serve_bench "$@"; rc=$? ;;
  fa2precompile) run python3 -m benchmarks.fa2_precompile "$@"; rc=$? ;;
  warmup) run python3 -m benchmarks.warmup_compile "$@"; rc=$? ;;
  longctx) run python3 -m benchmarks.long_context "$@"; rc=$? ;;
  # NVLink multicast stays off for the TP=2 engines (shared host; the test sets these too)
  tp2) NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} \
       TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
       NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} VLLM_ALLREDUCE_USE_SYMM_MEM=0 \
       run python3 -m pytest tests/e2e/test_tp2.py -m gpu -v -rA -s "$@"; rc=$? ;;
esac
# Results this call wrote to benchmarks/results (the scripts' default --out) go to $OUT too; only
# those, and never over a file already in $OUT: an accuracy run with --out $OUT/accuracy.json
# once had it replaced by the committed file of the same name.
find benchmarks/results -maxdepth 1 \( -name '*.json' -o -name '*.png' \) -newer "$started" \
  -exec cp -n {} "$OUT/" \; 2>/dev/null
# Where each engine's prefills ran (FlashAttention-2 or our kernels, and why): one line per process
# in the logs, gathered here so a call's output shows it without opening them.
grep -rhoa "int8kv-shim: first [A-Za-z0-9-]* *step with prefills: .*" "$OUT/logs" 2>/dev/null \
  | sort | uniq -c
echo "run_gpu_e2e: $step exited $rc; logs and results in $OUT"
exit "$rc"
