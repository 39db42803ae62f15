#!/bin/sh
# The whole test suite: dependencies, build, C tests, then every spec. A
# CUDA build without a GPU runs the suite on its CPU fallback; where a GPU
# is present the GPU specs (spec/gpu, tag gpu: ops, copies, the loader, the
# device choice, NCCL, every example) run after it. The first suite's
# multi-rank specs and example runs ask for CPU ranks (DSLUA_DEVICE=cpu),
# so they mean the same on a GPU machine.
set -e
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
(cd build && ctest --output-on-failure -j "$(nproc)" -E '^specs$')
build/dslua /usr/bin/busted "$@"
if [ $# -eq 0 ] && build/dslua -e "os.exit(require('dslua').cuda.is_available() and 0 or 1)"; then
  build/dslua /usr/bin/busted --tags=gpu --exclude-tags=none spec/gpu
fi
