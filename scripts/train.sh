#!/bin/sh
# The main job: dependencies, build, then a real training run: a character
# level GPT on the Lua source text the binary carries (no download).
set -e
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
build/dslua examples/quickstart/train.lua "$@"
