#!/bin/sh
# The main job: dependencies, build, then a real training run on data the
# script generates itself (no download).
set -e
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
build/dslua examples/spiral/train.lua "$@"
