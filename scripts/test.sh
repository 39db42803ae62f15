#!/bin/sh
# The whole test suite: dependencies, build, C tests, then every spec.
set -e
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
(cd build && ctest --output-on-failure -E '^specs$')
build/dslua /usr/bin/busted "$@"
