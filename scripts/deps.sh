#!/bin/sh
# Installs what dslua builds and runs with, from Debian's packages.
# Idempotent: packages already present are left as they are.
set -e
# clang, libclang-rt-dev, libomp-dev: the fuzz runs (scripts/fuzz.sh)
PKGS="build-essential cmake pkg-config luajit libluajit-5.1-dev libopenblas-dev
      libdnnl-dev libopenmpi-dev openmpi-bin zlib1g-dev libcjson-dev libedit-dev libssl-dev libcairo2-dev lua-busted
      clang libclang-rt-dev libomp-dev"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi
