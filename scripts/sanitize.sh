#!/bin/sh
# The C tests and the whole spec suite on a CPU-only build with
# AddressSanitizer and UndefinedBehaviorSanitizer (build-asan/, configured
# once). Every process a spec starts (ranks under mpirun included) writes
# its sanitizer report to a log folder; any report fails the run, even one
# whose output a spec swallowed. Arguments go to busted.
set -e
cd "$(dirname "$0")/.."
if [ ! -f build-asan/CMakeCache.txt ]; then
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSLUA_CUDA=OFF -DDSLUA_SANITIZE=ON > /dev/null
fi
cmake --build build-asan -j "$(nproc)"
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# leaks: LuaJIT, Open MPI and OpenMP keep memory to the end by design;
# a failed allocation returns NULL as it does without ASan (specs ask for
# impossible sizes); a small quarantine keeps the resident-size specs honest
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:quarantine_size_mb=16:log_path=$logs/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan"
status=0
(cd build-asan && ctest --output-on-failure -j "$(nproc)" -E '^specs$') || status=1
build-asan/dslua /usr/bin/busted "$@" || status=1
# reports, not the warnings a NULL-returning allocation prints
reports=$(grep -l -E 'ERROR: AddressSanitizer|runtime error:' "$logs"/* 2>/dev/null || true)
if [ -n "$reports" ]; then
  echo "scripts/sanitize.sh: sanitizer reports:" >&2
  cat $reports >&2
  status=1
fi
exit $status
