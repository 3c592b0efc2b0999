#!/usr/bin/env bash
# The numerics tests (pytest.mark.numerics: results that depend on float32 reduction order) again under float32
# reduction orders other than `make test`'s (issue 33): torch's portable kernels, then AVX2 kernels where the CPU
# has AVX2 (`make test` runs the CPU's native kernels, AVX-512 on many x86 machines), each on every core as
# pytest-xdist workers of one torch thread. Tolerances come from the arithmetic, not from one machine, so every
# setting passes; this shows a tolerance that does not before CI on another CPU does. Integration tests compare
# runs of one code path with itself: they are not repeated. (Until the tiers, the AVX2 setting ran on two threads
# in one process: 5 min of CI's 20; the integration tier and the pipeline still run multi-threaded.)
set -euo pipefail
cd "$(dirname "$0")/.."
sel=(-m "numerics and not integration")
run() {   # kernels, threads per process, extra pytest arguments
  echo "== ATEN_CPU_CAPABILITY=$1, $2 thread(s)"
  ATEN_CPU_CAPABILITY=$1 OMP_NUM_THREADS=$2 pytest -q -p no:cacheprovider "${sel[@]}" "${@:3}"
}
run default 1 -n "${CORES:-2}"
if grep -qw avx2 /proc/cpuinfo; then run avx2 1 -n "${CORES:-2}"; else echo "== no AVX2 on this CPU: skipped the avx2 setting"; fi
