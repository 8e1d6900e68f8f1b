#!/usr/bin/env bash
# Issue 16's device checks in one call, for a lent GPU (15 minutes per session, all tries
# together): the prepared benchmarks in order of value, each under its own time limit cut to
# what is left of BUDGET seconds, every log into $OUT (what the device tool brings back).
#
#   run(command="bash benchmarks/gpu_session.sh 540", carry=["benchmarks/.wheels"],
#       timeout_s=600)
#
# Order: the Lightning grid's launch-bound rows (B=1, H=8, D=64, S 2k-64k, fwd and fwd+bwd
# vs fla and SDPA), the same rows replayed from CUDA graphs (device time alone), the MoE
# profile at hidden 1024 (where the 0.80x of grouped_mm goes), the MoE grid (after the op's
# checks: its Triton SwiGLU and combine have not run on a GPU before). A step that
# would start with under 30 s left is skipped and says so in summary.txt. fla-core comes from
# the carried wheel (benchmarks/.wheels; see lightning_gpu.py's docstring); graphopt from
# this checkout (PYTHONPATH), nothing from the network.
set -u
budget=${1:-540}
out=${OUT:-$PWD/gpu_out}
mkdir -p "$out"
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
if ls benchmarks/.wheels/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        benchmarks/.wheels/*.whl > "$out/pip.log" 2>&1
else  # every fla column would be NaN: say so where the summary is read first
    echo "fla wheel missing: no benchmarks/.wheels/*.whl carried (pip download" \
        "flash-linear-attention fla-core --no-deps -d benchmarks/.wheels before the session)" \
        >> "$out/summary.txt"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export TORCHINDUCTOR_COMPILE_THREADS=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
} > "$out/env.txt"
step() {  # step NAME LIMIT_SECONDS command...
    local name=$1 limit=$2 remaining
    shift 2
    remaining=$(left)
    if [ "$remaining" -lt 30 ]; then
        echo "$name skipped: ${remaining}s left" >> "$out/summary.txt"
        return
    fi
    [ "$limit" -gt "$remaining" ] && limit=$remaining
    local t0=$(date +%s)
    (cd benchmarks && timeout "$limit" "$@") > "$out/$name.log" 2>&1
    echo "$name rc=$? $(($(date +%s) - t0))s (limit ${limit}s)" >> "$out/summary.txt"
}
step lightning 240 python3 lightning_gpu.py --quick --skip-checks --budget 180
step lightning_graphs 150 python3 lightning_gpu.py --quick --skip-checks --graphs --budget 100
step moe_profile 90 python3 moe_gpu.py --profile 0
step moe 150 python3 moe_gpu.py --op-checks-only
cat "$out/summary.txt"
