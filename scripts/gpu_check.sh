#!/usr/bin/env bash
# Every GPU check in one command, for the rare session with a GPU machine (DEVELOPERS.md).
#
#   bash scripts/gpu_check.sh [--out DIR] [--smoke] [--quick] [--steps NAME,NAME...]
#                             [--pack FILE] [--max-step-s N] [--install]
#
# Steps, each under its own timeout, each writing a log (and JSON where it has figures)
# under DIR (default: $OUT, else ./gpu-check-out):
#   env         nvidia-smi, torch / transformers versions, /dev/shm, ulimit -l, cores, memory
#   cuda-tests  pytest -m cuda tests/test_cuda.py tests/test_long_rows.py (its CUDA case:
#               fp32 grouped heads without the math kernel)
#   ipc-exit    scripts/ipc_event_after_exit.py: what an imported CUDA IPC event does once
#               its exporter was SIGKILLed (ipc_event_after_exit.json; docs/runtime.md)
#   bandwidth   benchmarks/bandwidth.py: pinned vs pageable copies, the engine's start-up test
#   parity      scripts/gpu_parity.py: a tiny job on a GPU worker vs CPU-worker losses
#   overlap     benchmarks/overlap.py (CPU, emulated bus)
#   throughput  benchmarks/gpu_throughput.py, Qwen3-1.7B shape (skipped with --quick)
#   vs-paper    Qwen3-1.7B in the paper's benchmark shape (sequence 2048, 10 microbatches of
#               13 rows: its 128-row step, 12.8 rows per microbatch, rounded up), this runtime
#               beside the paper's library (PyPI roundpipe 0.1.1 from .whl/ref, in /tmp/ref;
#               skipped with --quick): issue 32's RESULT vs_paper
#   moe         benchmarks/moe.py: a Qwen3-30B-A3B-shaped MoE layer against the dense layer
#   sync-mode   benchmarks/sync_mode.py: staleness 0 vs 1 on CPU workers, on a quiet many-core
#               host (issue 18's sync_vs_async; the shared 2-core machine is too noisy)
#   checkpoint  benchmarks/checkpoint.py: background vs drained checkpoints on CPU workers, on
#               a many-core host (issue 25's stall and write-bandwidth targets; skipped with --quick)
#   grad-buffer benchmarks/host_memory.py --throughput: what the bounded gradient buffer
#               costs in tokens/s on a quiet host (issue 24's < 2%)
#   qlora-cuda  pytest -m cuda tests/test_qlora.py tests/test_quant_format.py: NF4 / int8
#               dequantisation (ours and the bitsandbytes layout) on the GPU equal
#               to the CPU's, a GPU worker's quantised-base job equal to CPU workers' (issue 37)
#   qlora       benchmarks/qlora.py --device cuda: bf16 vs NF4 vs int8 base (issue 37)
#   optimizer   benchmarks/optimizer.py on every core of the machine (issue 18's many-core
#               figure)
#   long-context benchmarks/long_context_gpu.py: the Qwen3-1.7B shape at 73,728 and 102,400
#               tokens per row on one GPU worker under --memory-limit 24GiB, against the
#               planner's figures (issue 36's GPU target: >= 73K, goal 100K)
#   parity-fp16 scripts/gpu_parity.py --dtype float16: the same with float16 and its
#               dynamic loss scaling (the scaled seed, fp16 kernels) on the GPU
# summary.json lists every step with its exit status and seconds. The device tool allows
# 10 minutes per command and the step limits add up to more: split a GPU session's checks
# over several commands with --steps, e.g. `--steps env,cuda-tests,ipc-exit,bandwidth,parity`, then
# `--steps throughput`, `--steps vs-paper`, `--steps overlap,optimizer,moe`, `--steps sync-mode`,
# `--steps checkpoint,grad-buffer`, `--steps qlora-cuda,qlora`, `--steps long-context`,
# `--steps parity-fp16`.
#
# The GPU machine has no package registry: wheels fetched beforehand into .whl/
# (../shared/tools/device-wheels.sh: pyzmq, msgspec) are installed into /tmp/site first.
# The qlora steps need no bitsandbytes (the tests build its layout themselves, and nothing
# the steps run imports it): carry no bitsandbytes wheel (43 MB of the 64 MiB a call may
# carry).
# On the GPU machine, run it as
#   bash scripts/gpu_check.sh --out /tmp/gpu-check --pack $OUT/gpu-check.tgz --steps ...
# --pack archives DIR into FILE after every step (the device tool brings back at most 8
# files, and nothing of a command stopped at its limit but what is already under $OUT), and
# --max-step-s caps every step's limit (a machine's start can take minutes of the session's
# device time, which leaves a call less than its timeout). Steps run in this script's order.
# --smoke rehearses the whole script on a machine without a GPU (CPU workers, tiny sizes);
# tests/test_gpu_check.py runs it so, with --install: the checkout is installed into a
# scratch directory even where an install exists, as on the GPU machine, so a step that
# reads the checkout's files where the installed package's are meant fails here too.
set -uo pipefail
cd "$(dirname "$0")/.."

out=${OUT:-gpu-check-out}
smoke=0
quick=0
only=""  # --steps: a comma-separated subset (default: every step)
pack=""  # --pack: a tarball of DIR, rewritten after every step
max_step_s=""  # --max-step-s: cap on every step's limit
install=0  # --install: install this checkout even where roundpipe is importable
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --smoke) smoke=1; shift ;;
    --quick) quick=1; shift ;;
    --steps) only=$2; shift 2 ;;
    --pack) pack=$2; shift 2 ;;
    --max-step-s) max_step_s=$2; shift 2 ;;
    --install) install=1; shift ;;
    *) echo "gpu_check.sh: unknown option $1 (see the header of this script)" >&2; exit 2 ;;
  esac
done
# Every step's name, in the order they run; --steps takes only these (a typo would
# otherwise skip a step silently and spend a GPU call on nothing).
all_steps="env cuda-tests ipc-exit bandwidth parity overlap throughput vs-paper optimizer moe
  sync-mode checkpoint grad-buffer qlora-cuda qlora long-context parity-fp16"
for name in ${only//,/ }; do
  if [[ " $(echo $all_steps) " != *" $name "* ]]; then
    echo "gpu_check.sh: unknown step '$name' in --steps; steps: $(echo $all_steps)" >&2
    exit 2
  fi
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
repo=$(pwd)
rundir=$(mktemp -d -t gpu-check-XXXX)
trap 'rm -rf "$rundir"' EXIT
export GPU_CHECK_OUT=$out
export PYTHONUNBUFFERED=1

summary=()
step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then
    return 0
  fi
  if [ -n "$max_step_s" ] && [ "$max_step_s" -lt "$limit" ]; then
    limit=$max_step_s
  fi
  local started=$SECONDS
  echo "== $name (limit ${limit}s)"
  # from a neutral directory, for the reason given at the install (every path is absolute)
  (cd "$rundir" && timeout --kill-after=10 "$limit" "$@") >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$out/$name.log"
  echo "== $name: exit $rc in $((SECONDS - started))s"
  summary+=("{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - started))}")
  write_summary
}

write_summary() {  # summary.json so far; with --pack, DIR archived into FILE
  {
    echo "["
    for i in "${!summary[@]}"; do
      sep=","; [ "$i" -eq $((${#summary[@]} - 1)) ] && sep=""
      echo "  ${summary[$i]}$sep"
    done
    echo "]"
  } >"$out/summary.json"
  if [ -n "$pack" ]; then
    tar czf "$pack.part" --exclude='*.jsonl' --exclude='*.safetensors' --exclude='*.pt' --exclude='*.sock' \
      --exclude=keys -C "$out" . && mv "$pack.part" "$pack"
  fi
}

install_failed() {  # the install's output where the pack brings it back, then stop
  echo "gpu_check.sh: $1 failed; its output is in $out/install.log" >&2
  tail -n 30 "$out/install.log" >&2
  summary+=("{\"step\": \"install\", \"exit\": 2, \"seconds\": $SECONDS}")
  write_summary
  exit 2
}
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import zmq, msgspec" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$out/install.log" 2>&1 || install_failed "installing .whl/"
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# Without an installed checkout (the bare GPU machine), install this tree, offline. The
# check runs outside the checkout: python -m puts the working directory first on sys.path,
# where the checkout's roundpipe/ folder (the package's top level only; its subpackages
# live in coordinator/, worker/, ...) would shadow the installed package.
if [ $install -eq 1 ] || ! (cd / && python3 -c "import roundpipe.worker.transfer") 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --upgrade \
    --target "$rundir/site" . >>"$out/install.log" 2>&1 || install_failed "installing this checkout"
  export PYTHONPATH=$rundir/site:${PYTHONPATH:-}
fi

# The paper's library, for vs-paper: its own directory, on PYTHONPATH only in its process.
if ls .whl/ref/*.whl >/dev/null 2>&1 && [ ! -d /tmp/ref/roundpipe ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/ref .whl/ref/*.whl \
    >>"$out/install.log" 2>&1 \
    || echo "gpu_check.sh: installing the paper's library from .whl/ref failed (install.log)" >&2
fi

step env 60 python3 - <<'PY'
import json, os, platform, shutil, subprocess, sys, sysconfig
def run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"
import psutil, torch, transformers
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
info = {
    "python": sys.version.split()[0],
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "cuda_available": torch.cuda.is_available(),
    "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "transformers": transformers.__version__,
    "nvidia_smi": run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current", "--format=csv,noheader"]),
    "dev_shm_bytes": shutil.disk_usage("/dev/shm").total,
    "ulimit_l": run(["bash", "-c", "ulimit -l"]),
    "cores": os.cpu_count(),
    "memory_bytes": psutil.virtual_memory().total,
    "platform": platform.platform(),
    # the paper's library compiles its CPU optimizer on first use (vs-paper): a compiler
    # and this Python's headers must be there
    "gxx": run(["g++", "--version"]).splitlines()[0] if shutil.which("g++") else None,
    "python_h": os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
    # what the install and the steps depend on (setuptools builds the checkout here)
    "packages": {n: version(n) for n in (
        "setuptools", "pip", "numpy", "peft", "accelerate", "safetensors", "tokenizers",
        "huggingface-hub", "bitsandbytes", "pyzmq", "msgspec", "numba", "datasets")},
}
print(json.dumps(info, indent=1))
json.dump(info, open(os.path.join(os.environ["GPU_CHECK_OUT"], "env.json"), "w"), indent=1)
PY

if [ $smoke -eq 1 ]; then
  step cuda-tests 600 python3 -m pytest -q "$repo"/tests/test_cuda.py
  step bandwidth 120 python3 "$repo"/benchmarks/bandwidth.py --smoke
  step parity 600 python3 "$repo"/scripts/gpu_parity.py --smoke --steps 3 --json "$out/parity.json"
  step overlap 600 python3 "$repo"/benchmarks/overlap.py --smoke
  [ $quick -eq 1 ] || step throughput 600 python3 "$repo"/benchmarks/gpu_throughput.py --smoke
  step optimizer 300 python3 "$repo"/benchmarks/optimizer.py --smoke --no-paper
  step moe 300 python3 "$repo"/benchmarks/moe.py --smoke
  step sync-mode 120 python3 "$repo"/benchmarks/sync_mode.py --no-runtime
  [ $quick -eq 1 ] || step checkpoint 300 python3 "$repo"/benchmarks/checkpoint.py --smoke
  [ $quick -eq 1 ] || step long-context 300 python3 "$repo"/benchmarks/long_context_gpu.py \
    --smoke --workdir "$out/long-context-work"
else
  # The CUDA cases only: test_transfer's and test_handoff's other tests are CPU work the
  # suite runs anyway, and test_handoff's ipc-exit probe is the ipc-exit step's.
  step cuda-tests 600 python3 -m pytest -q -m cuda "$repo"/tests/test_cuda.py \
    "$repo"/tests/test_long_rows.py
  step ipc-exit 300 python3 "$repo"/scripts/ipc_event_after_exit.py --out "$out"
  step bandwidth 120 python3 "$repo"/benchmarks/bandwidth.py
  step parity 600 python3 "$repo"/scripts/gpu_parity.py --json "$out/parity.json"
  step overlap 600 python3 "$repo"/benchmarks/overlap.py --iterations 2
  [ $quick -eq 1 ] || step throughput 600 python3 "$repo"/benchmarks/gpu_throughput.py \
    --models qwen3-1.7b --systems runtime-1w,plain --steps 3 --warmup 1 \
    --workdir "$out/throughput-work"
  [ $quick -eq 1 ] || step vs-paper 600 python3 "$repo"/benchmarks/gpu_throughput.py \
    --models qwen3-1.7b --systems runtime-1w,paper --paper-site /tmp/ref --steps 3 --warmup 1 \
    --seq-len 2048 --microbatches 10 --rows 13 --workdir "$out/vs-paper-work"
  step optimizer 300 python3 "$repo"/benchmarks/optimizer.py
  step moe 300 python3 "$repo"/benchmarks/moe.py --shape full --device cuda --dtype bfloat16 --no-eager
  step sync-mode 600 python3 "$repo"/benchmarks/sync_mode.py --no-clip-runs --repeats 3
  step checkpoint 330 python3 "$repo"/benchmarks/checkpoint.py --repeats 2 --workers 4
  step grad-buffer 270 python3 "$repo"/benchmarks/host_memory.py --throughput --rounds 3
  step qlora-cuda 300 python3 -m pytest -q -m cuda "$repo"/tests/test_qlora.py \
    "$repo"/tests/test_quant_format.py
  step qlora 300 python3 "$repo"/benchmarks/qlora.py --device cuda
  step long-context 540 python3 "$repo"/benchmarks/long_context_gpu.py \
    --workdir "$out/long-context-work"
  step parity-fp16 600 python3 "$repo"/scripts/gpu_parity.py --dtype float16 --rtol 1e-2 \
    --json "$out/parity-fp16.json" --workdir "$out/parity-fp16-work"
fi

write_summary
cat "$out/summary.json"
failed=$(grep -c '"exit": [1-9]' "$out/summary.json")
echo "gpu_check.sh: $failed step(s) failed; logs in $out"
[ "$failed" -eq 0 ]
