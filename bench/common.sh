# shellcheck shell=bash disable=SC2154  # me, threads, rounds, build: set by the driver
# Shared by the bench/*.sh drivers (sourced): the project root, the cores,
# the -t/-r checks and building dslua. $me names the driver in messages.

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)   # nproc obeys those two

# Checks -t THREADS and -r ROUNDS and hands the thread count to dslua,
# OpenMP and OpenBLAS.
bench_threads() {
    if ! [[ $threads =~ ^[1-9][0-9]*$ && $rounds =~ ^[1-9][0-9]*$ ]]; then
        echo "$me: -t and -r want whole numbers >= 1 (got '$threads', '$rounds')" >&2
        exit 2
    fi
    export DSLUA_NUM_THREADS=$threads OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
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
    build=$root/build
    quick=
    local opt OPTIND=1
    while getopts "b:qh" opt; do
        case $opt in
        b) build=$(realpath -m "$OPTARG") ;;
        q) quick=quick ;;
        h) usage; exit 0 ;;
        *) usage >&2; exit 2 ;;
        esac
    done
}
