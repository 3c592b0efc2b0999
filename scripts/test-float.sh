#!/usr/bin/env bash
# The numerics tests (pytest.mark.numerics: results that depend on float32 reduction order) again under float32
# reduction orders other than `make test`'s (issue 33): torch's portable kernels and AVX2 kernels where the CPU has
# AVX2 (`make test` runs the CPU's native kernels, AVX-512 on many x86 machines), each on every core as pytest-xdist
# workers of one torch thread. Tolerances come from the arithmetic, not from one machine, so every setting passes;
# this shows a tolerance that does not before CI on another CPU does. Integration tests compare runs of one code path
# with itself: they are not repeated. Nor are the validation tier's: they judge a Monte-Carlo estimate within its
# sampling error, which other kernels cannot move past (another reduction order is another draw of the same chain,
# and the test's false-alarm rate already counts draws); 11 tests, about 120 s of test time on 2026-12-07.
# Each run splits the numerics test files in two halves (alternate files in name order) and runs one half under each
# setting; which half meets which setting follows the parity of the commit's hash, so over two commits every test
# meets both. That is half the time of every test under both (405 s of CI's 25 min on 2026-12-06). FLOAT_ALL=1 runs
# every test under both settings, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
sel=(-m "numerics and unit")
run() {   # kernels, threads per process, extra pytest arguments
  echo "== ATEN_CPU_CAPABILITY=$1, $2 thread(s)"
  ATEN_CPU_CAPABILITY=$1 OMP_NUM_THREADS=$2 pytest -q -p no:cacheprovider "${sel[@]}" "${@:3}"
}
if ! grep -qw avx2 /proc/cpuinfo; then
  echo "== no AVX2 on this CPU: the portable kernels only, every numerics test"
  run default 1 -n "${CORES:-2}"
  exit
fi
if [ "${FLOAT_ALL:-0}" = 1 ]; then
  run default 1 -n "${CORES:-2}"
  run avx2 1 -n "${CORES:-2}"
  exit
fi
mapfile -t files < <(pytest -q -p no:cacheprovider --collect-only "${sel[@]}" | sed -n 's/::.*//p' | sort -u)
half=(); other=()
for i in "${!files[@]}"; do
  if (( i % 2 == 0 )); then half+=("${files[$i]}"); else other+=("${files[$i]}"); fi
done
parity=$(( 0x$(git rev-parse --short=7 HEAD 2>/dev/null || echo 0) % 2 ))
echo "== commit parity $parity: ${#half[@]} + ${#other[@]} files"
if (( parity == 0 )); then a=("${half[@]}") b=("${other[@]}"); else a=("${other[@]}") b=("${half[@]}"); fi
run default 1 -n "${CORES:-2}" "${a[@]}"
run avx2 1 -n "${CORES:-2}" "${b[@]}"
