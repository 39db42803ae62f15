#!/bin/sh
# Short libFuzzer runs (clang, ASan + UBSan) of the dataset readers, the
# JSON decoder with the config checker, the safetensors reader, the
# checkpoint manifest's reader and the TensorBoard event reader, from the
# small corpora in fuzz/corpus/<target> (left as they are: new inputs go
# to a temporary folder).
# SECONDS_EACH (default 30) per target. A crash, a leak or a checker that
# raises fails the run; the input that did it is kept in build-fuzz/.
set -e
cd "$(dirname "$0")/.."
seconds=${1:-30}
if [ ! -f build-fuzz/CMakeCache.txt ]; then
  CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSLUA_CUDA=OFF -DDSLUA_SANITIZE=ON \
    -DDSLUA_FUZZ=ON -DDSLUA_WERROR=OFF > /dev/null
fi
targets="data config safetensors manifest tfevents"
cmake --build build-fuzz -j "$(nproc)" $(for t in $targets; do printf ' --target fuzz_%s' "$t"; done)
export ASAN_OPTIONS="allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
for target in $targets; do
  work=$(mktemp -d)
  echo "fuzz_$target: $seconds s from fuzz/corpus/$target"
  if ! build-fuzz/fuzz_$target -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=2048 \
       -artifact_prefix=build-fuzz/ -print_final_stats=1 "$work" "fuzz/corpus/$target" > "build-fuzz/fuzz_$target.log" 2>&1; then
    tail -40 "build-fuzz/fuzz_$target.log" >&2
    rm -rf "$work"
    exit 1
  fi
  grep -E '^#[0-9]+.*DONE|stat::number_of_executed_units' "build-fuzz/fuzz_$target.log" | head -2
  rm -rf "$work"
done
