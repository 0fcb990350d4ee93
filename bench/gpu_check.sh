#!/usr/bin/env bash
# The GPU check in one call (issue 42): the CUDA tests, then `python -m bench --device cuda`,
# the report and every log under one directory. Nothing is installed from a registry there.
#
#   bench/gpu_check.sh prepare    here, before a GPU session: Python 3.12 wheels of what the GPU
#                                 machine lacks (zstandard) into .whl/ (git-ignored)
#   bench/gpu_check.sh [OUT] [--device cpu] [--quick]
#                                 there (OUT defaults to $OUT, else ./gpu-check): installs .whl/
#                                 into /tmp/site, builds the C extension for its Python if a
#                                 compiler is there (else the NumPy filters), runs
#                                 tests/test_cuda.py and the bench
#
# On the lent machine, from the repository root, with the device tool:
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Then commit $OUT/report.md and results.json under bench/results/gpu/. On a CPU machine
# `bench/gpu_check.sh DIR --device cpu --quick` runs the same steps (the CUDA tests skip).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = prepare ]; then
    mkdir -p .whl
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl 'zstandard>=0.21'
fi
out=${OUT:-gpu-check}
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then out=$1; shift; fi
device=cuda bench_args=()
for arg in "$@"; do
    case $arg in
        --device) ;;
        cpu|cuda) device=$arg ;;
        --quick) bench_args+=(--quick) ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1
exec > >(tee "$out/check.log") 2>&1
tee_pid=$!
finish() {  # tee sees the end of its input: give it a moment to write check.log whole (a
    exec >&- 2>&-  # leftover process still holding the pipe must not hang the call)
    for _ in $(seq 50); do kill -0 "$tee_pid" 2>/dev/null || break; sleep 0.1; done
    exit "$1"
}
echo "== $(date -u +%FT%TZ) gpu_check on $(hostname): device $device"
if ! "$PY" -c "import zstandard" 2>/dev/null; then
    ls .whl/*.whl >/dev/null 2>&1 || { echo "zstandard is missing and .whl/ holds no wheels:" \
        "run 'bench/gpu_check.sh prepare' where pip works and carry .whl"; finish 3; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || finish 3
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if "$PY" -c "import async_ckpt._native" 2>/dev/null; then
    echo "C extension present"
else  # this Python's build of it (the tree may carry another Python's)
    "$PY" setup.py -q build_ext --inplace >"$out/build.log" 2>&1 \
        && echo "C extension built" || echo "C extension not built (see build.log): NumPy filters"
fi
nvidia-smi 2>&1 | head -15 || true
"$PY" -c "import torch, async_ckpt; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'devices', torch.cuda.device_count(), 'async_ckpt', async_ckpt.__version__)"
status=0
timeout 180 "$PY" -m pytest -q -n 0 -p no:cacheprovider -rs tests/test_cuda.py \
    --junitxml="$out/test_cuda.xml" || status=1
timeout 330 "$PY" -m bench --device "$device" "${bench_args[@]}" --out "$out" \
    2>"$out/bench.log" >/dev/null || status=1
tail -5 "$out/bench.log"
[ -f "$out/report.md" ] && cat "$out/report.md"
echo "== gpu_check done: status $status (0: every CUDA test passed or skipped, the bench ran and every restore was exact)"
finish $status
