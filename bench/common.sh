# shellcheck shell=bash disable=SC2154  # me, threads, rounds, ranks: set by the driver
# Shared by the bench/*.sh drivers (sourced): the project root, the cores,
# the shared options and checks, building dslua, a table's title and
# mpirun. $me names the driver in messages.

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)   # nproc obeys those two
build=$root/build      # -b and -q (bench_opt) change these two
quick=

# Checks -t THREADS and -r ROUNDS and hands the thread count to dslua,
# OpenMP and OpenBLAS.
bench_threads() {
    if ! [[ $threads =~ ^[1-9][0-9]*$ && $rounds =~ ^[1-9][0-9]*$ ]]; then
        echo "$me: -t and -r want whole numbers >= 1 (got '$threads', '$rounds')" >&2
        exit 2
    fi
    bench_export_threads "$threads"
}

# Builds dslua in $build, configuring it as Release if absent (a bare
# binary there is used as it is). Timings of a Debug build mean nothing:
# refuse one rather than reconfigure it.
bench_build() {
    local type log
    # a binary carried to a GPU machine without its build tree (../shared/device)
    if [[ ! -f $build/CMakeCache.txt && -x $build/dslua ]]; then return; fi
    if [[ -f $build/CMakeCache.txt ]]; then
        type=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$build/CMakeCache.txt")
        if [[ $type != Release ]]; then
            echo "$me: $build is a '$type' build; point -b at a Release build (or a new dir)" >&2
            exit 1
        fi
    else
        cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
    fi
    log=$(mktemp)
    if ! cmake --build "$build" --target dslua -j"$cores" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "$me: building dslua failed" >&2
        exit 1
    fi
    rm -f "$log"
}

# Parses -b BUILD_DIR, -q and -h into $build and $quick: the options of a
# driver that has no others (its usage function prints the help).
bench_build_quick_options() {
    local opt OPTIND=1
    while getopts "b:qh" opt; do bench_opt "$opt"; done
}

# The getopts cases every driver shares: -b BUILD_DIR, -q, -h and an
# unknown option. The driver's own cases come first in its case.
bench_opt() {
    case $1 in
    b) build=$(realpath -m "$OPTARG") ;;
    q) quick=quick ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
    esac
}

# Gives dslua, OpenMP and OpenBLAS $1 threads each.
bench_export_threads() {
    export DSLUA_NUM_THREADS=$1 OMP_NUM_THREADS=$1 OPENBLAS_NUM_THREADS=$1
}

# $ranks ranks share the cores: $threads threads each (at least one).
bench_rank_threads() {
    threads=$((cores / ranks > 0 ? cores / ranks : 1))
    bench_export_threads "$threads"
}

# torch=1 where /usr/bin/python3 has PyTorch; else empty, and a line on
# stderr ending in $1 (what the table shows instead).
# shellcheck disable=SC2034  # torch is the driver's
bench_torch() {
    torch=1
    if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
        echo "$me: no PyTorch in /usr/bin/python3; $1" >&2
        torch=
    fi
}

# The load average now (the 1, 5 and 15 minute figures).
bench_load() { cut -d' ' -f1-3 /proc/loadavg; }

# The first line of a table: what ran ($1), when and on which commit.
bench_title() {
    local commit
    commit=$(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)
    echo "dslua $1  $(date -u '+%Y-%m-%d %H:%M UTC')  commit $commit${quick:+  (quick)}"
}

# The CPU's model name.
bench_cpu() { sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1; }

# mpirun on $1 ranks of this machine over shared memory, forwarding the
# thread counts, DSLUA_COMM_CHECK, DSLUA_DEVICE and DSLUA_ALLOC_CACHE_MB
# where set; then the program and its arguments.
bench_mpirun() {
    local np=$1 v x=()
    shift
    for v in DSLUA_NUM_THREADS OMP_NUM_THREADS OPENBLAS_NUM_THREADS DSLUA_COMM_CHECK DSLUA_DEVICE DSLUA_ALLOC_CACHE_MB; do
        if [[ -v $v ]]; then x+=(-x "$v"); fi
    done
    mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader "${x[@]}" -np "$np" "$@"
}
