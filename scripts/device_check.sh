#!/usr/bin/env bash
# The GPU checks in one run of 420 s on a GPU machine, the most important
# evidence first:
#   1. the report;
#   2. four lanes side by side on the GPU: the C test with a GPU case
#      (build/test_zero: ZeRO-Offload's pipeline on the copy stream), then
#      the GPU suite (fp8, ZeRO and GPT-2; every op against the CPU, TF32
#      attention among them, and on compute capability 9.0 the wgmma
#      attention against mma.sync; the rest; every example); the staged path's
#      primitives with device tensors, then each multi-rank spec with
#      device ranks over MPI; each over NCCL's backend with the NCCL test
#      double (spec/gpu/multirank_spec.lua); GPT-2 124M's loss curve
#      against PyTorch's over 100 steps (bench/curve.sh);
#   3. one after another, alone on the GPU: GPT-2 124M in bf16 at B=16
#      (dslua, then PyTorch eager), fp32 under TF32 at B=8 (both), fp8 at
#      B=16, the real vocab 50257 at B=16 (against 50304), GPT-2 XL with
#      ZeRO-Offload against without (bench/gpu.lua), bench/staged.sh.
# Each part runs under its own time limit (plus what the parts before it
# in its lane left unused, and in a lane shorter than the longest the
# difference), cut to what is left of the budget
# (DEVICE_CHECK_SECONDS, default 420). Its log goes to $OUT/NAME.log
# (default: device_check/) and a line to $OUT/summary.txt: ok, FAIL, CUT
# (timed out, or left out for want of time), NOGPU (passed without
# seeing the GPU) or EMPTY (no test ran, a bench skipped); then the bench rows' table. Exit status 1 where a part
# was not ok.
#
#   bash scripts/device_check.sh --plan   the parts and their limits; exit
#       status 1 where a file a part runs is missing, a C test with a GPU
#       case is not run or the limits pass the budget
#   DEVICE_CHECK_PARTS='bench_xl bench_xl_offload'   only these parts
#
# Here: a CUDA build (scripts/build.sh finds nvcc), echo /.device/ >>
# .git/info/exclude once, then from the project root
#   ../shared/device/bundle.sh
# There, in one call (the bundle and the NCCL double carried):
#   run(command="bash scripts/device_check.sh",
#       carry=[".device", "build/libnccl_double.so"], timeout_s=480)
# A second try, with the device time that is left: the parts that failed
# or were cut, e.g.
#   run(command="DEVICE_CHECK_PARTS='gpu_ops mpi_zero' DEVICE_CHECK_SECONDS=150 bash scripts/device_check.sh",
#       carry=[".device", "build/libnccl_double.so"], timeout_s=200)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
mode=run
case ${1:-} in
--plan) mode=plan ;;
'') ;;
*)
    echo "usage: bash scripts/device_check.sh [--plan]" >&2
    exit 2
    ;;
esac
budget=${DEVICE_CHECK_SECONDS:-420}
parts=${DEVICE_CHECK_PARTS:-}
only=" ${parts//,/ } "
out=${OUT:-device_check}
summary=$out/summary.txt
if [[ $mode == run ]]; then
    mkdir -p "$out"
    : > "$summary"
    # shellcheck disable=SC1091  # made by ../shared/device/bundle.sh
    if [[ -f .device/env.sh ]]; then . .device/env.sh; fi
fi
start=$(date +%s)     # after the bundle's unpacking: timeout_s=480 leaves a minute for it
busted=${BUSTED:-/usr/bin/busted}

planned=0     # the plan's clock: seconds from the start by which the parts so far are due to end
lane=-        # the lane a part runs in (- outside lanes)
lane_end=0    # in a lane: when its parts so far are due to end
counting=     # set while lanes measures a lane
ran=          # every command of the plan, for the checks
problems=()

# Files under the project's folders that a part runs must exist.
need_files() {
    local name=$1 a
    shift
    for a; do
        a=${a#--*=}
        if [[ $a =~ ^(spec|bench|tests|scripts|examples)/ && ! -e $a ]]; then
            problems+=("part $name runs $a, which does not exist")
        fi
    done
}

# A line of the summary (and of the output).
say() { printf '%s\n' "$*" | tee -a "$summary"; }

# part NAME SECONDS COMMAND...: in the plan a line; else, where asked, the
# command under its limit, its log in $out/NAME.log and a line in the
# summary: ok, FAIL, CUT (timed out or left out), NOGPU (passed without
# seeing the GPU) or EMPTY (no test ran, a bench skipped), its exit status, time, and
# busted's tally (or the log's last line). A part may also take what the parts before it in its lane
# left unused; the budget cuts it.
part() {
    local name=$1 limit=$2 due now left t0 rc tally state cut=
    shift 2
    if [[ $lane == - ]]; then ((due = planned += limit)); else ((due = lane_end += limit)); fi
    [[ -n $counting ]] && return
    need_files "$name" "$@"
    ran+=" $* "
    if [[ $mode == plan ]]; then
        printf '%-6s %-22s %4d s  %s\n' "$lane" "$name" "$limit" "$*"
        return
    fi
    [[ $only == "  " || $only == *" $name "* ]] || return 0
    now=$(($(date +%s) - start))
    left=$((due < budget ? due - now : budget - now))
    if ((left < limit)); then
        # left out only where under 10 s and under half its limit are left: a short part begun a
        # second late (the clock counts whole seconds) runs cut, it is not left out
        if ((left < 10 && 2 * left < limit)); then
            say "$(printf 'CUT   %-22s left out: %d s left of its %d s' "$name" "$left" "$limit")"
            return
        fi
        cut=" (cut from $limit s)"
    fi
    limit=$left t0=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    tally=$(grep -E '^[0-9]+ success(es)? / ' "$out/$name.log" | tail -1)
    [[ -z $tally ]] && tally=$(tail -1 "$out/$name.log")
    state=ok
    ((rc != 0)) && state=FAIL
    if ((rc == 124 || rc == 137)); then
        state=CUT tally="timed out after $limit s$cut${tally:+; $tally}"
    elif ((rc == 0)) && grep -qE 'skipped: no CUDA device|on a GPU skipped' "$out/$name.log"; then
        state=NOGPU
    elif [[ $tally == "0 successes / "* ]]; then
        state=EMPTY     # a filter whose tests are gone, or a describe's pending filtered out with them
    elif ((rc == 0)) && grep -qE '^bench/[a-z0-9_]+\.sh: skipped: ' "$out/$name.log"; then
        state=EMPTY     # a bench driver without its data
    fi
    say "$(printf '%-5s %-22s rc=%-3s %4d s  %s' "$state" "$name" "$rc" "$(($(date +%s) - t0))" "$tally")"
}

# lanes FUNCTION...: each function's parts one after another, the
# functions side by side; the plan's clock goes on from the longest. A
# shorter lane's clock starts late: its parts may take the difference.
lanes() {
    local f end=$planned
    local -A length
    for f; do
        lane=$f lane_end=$planned counting=1
        "$f"
        counting=
        length[$f]=$((lane_end - planned))
        ((lane_end > end)) && end=$lane_end
    done
    for f; do
        lane=$f lane_end=$((end - length[$f]))
        if [[ $mode == plan ]]; then "$f"; else "$f" & fi
    done
    wait
    lane=- planned=$end
}

gpu=(build/dslua "$busted" --tags=gpu --exclude-tags=none)
first=(spec/gpu/fp8_spec.lua spec/gpu/zero_spec.lua spec/gpu/gpt2_spec.lua)
rest=()
for f in spec/gpu/*_spec.lua; do
    case " ${first[*]} spec/gpu/ops_spec.lua spec/gpu/examples_spec.lua spec/gpu/multirank_spec.lua " in
    *" $f "*) ;;
    *) rest+=("$f") ;;
    esac
done
# the specs spec/gpu/multirank_spec.lua runs on device ranks (its SPECS),
# each over one path in its own part: seconds each (20 where not named)
mapfile -t multirank < <(sed -n 's/^local SPECS = {\(.*\)}/\1/p' spec/gpu/multirank_spec.lua 2>/dev/null |
    grep -o '[a-z0-9_]\+')
((${#multirank[@]})) || problems+=("no SPECS list in spec/gpu/multirank_spec.lua")
declare -A multirank_s=([ddp]=10 [zero]=25 [uneven]=10 [pipe]=25 [onebit]=30 [checkpoint]=45 [reload]=15 [tp]=10)

# multirank PATH FILTER: each of those specs over one path
multirank() {
    local s
    for s in "${multirank[@]}"; do
        part "${1}_$s" "${multirank_s[$s]:-20}" "${gpu[@]}" --filter=" ${s}_spec over $2" spec/gpu/multirank_spec.lua
    done
}
# 4 threads for the CPU's side: the MPI lanes' ranks (a thread each) poll
# busily, and OpenMP's threads on cores taken wait the longer
suite() {
    local -x DSLUA_NUM_THREADS=4 OMP_NUM_THREADS=4 OPENBLAS_NUM_THREADS=4
    part c_test_zero 15 build/test_zero
    part gpu_first 35 "${gpu[@]}" "${first[@]}"
    part gpu_ops 45 "${gpu[@]}" spec/gpu/ops_spec.lua
    part gpu_rest 45 "${gpu[@]}" "${rest[@]}"
    part gpu_examples 60 "${gpu[@]}" spec/gpu/examples_spec.lua
}
# one thread a rank, 2-4 ranks each, one GPU
mpi() {
    part primitives 30 "${gpu[@]}" --filter='primitive' spec/gpu/multirank_spec.lua
    multirank mpi 'MPI %(staged%)'
}
nccl() { multirank nccl 'NCCL %(the test double%)'; }
# GPT-2 124M's loss curve against PyTorch's: numerics, which sharing the GPU
# does not change, so beside the others (8 GiB of the GPU's memory each
# side), with its limit and the longest lane's spare. 40 s: bench/README.md's
# H100 rows at B=8, 381K and 298K tokens/s, are 100 steps in 2.1 and 2.7 s;
# on top dslua's start-up and 0.5 GB of weights written and read (~8 s),
# PyTorch's import and first steps (~8 s, what bench_bf16_torch's 25 s
# allow beside its 18 steps), and the steps' time again where the other
# lanes share the GPU
curve() { part curve 40 bash bench/curve.sh; }

if [[ $mode == run ]]; then
    say "device check $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git describe --always --dirty 2>/dev/null || echo unknown)," \
        "budget $budget s${parts:+, parts: $parts}"
    say "GPU: $(nvidia-smi -L 2>/dev/null | head -1)"
    # the plan in $out/plan.txt; its complaints (a file missing, the budget
    # exceeded) head the summary, and the parts still run
    bash scripts/device_check.sh --plan 2>&1 >"$out/plan.txt" | tee -a "$summary"
fi
part report 10 build/dslua --report
lanes suite mpi nccl curve
part bench_bf16 20 build/dslua bench/gpu.lua train 16 bf16 50304
part bench_bf16_torch 25 python3 bench/gpu_torch.py train 16 bf16 50304
part bench_tf32 20 build/dslua bench/gpu.lua train 8 tf32 50304
part bench_tf32_torch 25 python3 bench/gpu_torch.py train 8 tf32 50304
part bench_fp8 20 build/dslua bench/gpu.lua train 16 fp8 50304
part bench_vocab50257 20 build/dslua bench/gpu.lua train 16 bf16 50257
part bench_xl 25 build/dslua bench/gpu.lua train 4 bf16 50304 gpt2_xl quick
part bench_xl_offload 40 build/dslua bench/gpu.lua train 4 bf16 50304 gpt2_xl offload quick
part staged 15 bash bench/staged.sh -q

if [[ $mode == plan ]]; then
    # the C tests that look for a GPU of their own
    for f in tests/test_*.c tests/test_*.cc; do
        t=${f##*/}
        t=build/${t%.*}
        if grep -q 'ds_cuda_device_count' "$f" && [[ $ran != *" $t "* ]]; then
            problems+=("$f has a GPU case but no part runs $t")
        fi
    done
    # (a second try's parts share its budget as they come)
    if [[ -z $parts ]] && ((planned > budget)); then
        problems+=("the parts need $planned s, over the $budget s budget")
    fi
    echo "planned $planned s of the $budget s budget (side by side lanes: the longest counts)"
    if ((${#problems[@]})); then
        printf 'device_check: %s\n' "${problems[@]}" >&2
        exit 1
    fi
    exit 0
fi
if compgen -G "$out/bench_*.log" > /dev/null; then
    cat "$out"/bench_*.log | awk -F'\t' -f bench/gpu_table.awk | tee -a "$summary"
    grep -h '^bench/gpu.lua: ' "$out"/bench_*.log | tee -a "$summary"    # ms a step and the last loss
fi
[[ -f $out/curve.log ]] && grep -E '^(worst step|mean gap|within) ' "$out/curve.log" | tee -a "$summary"
[[ -f $out/staged.log ]] && sed -n '/^cpu: /,$p' "$out/staged.log" | tee -a "$summary"
say "total $(($(date +%s) - start)) s"
# exit status 1 where a part was not ok
! grep -qE '^(FAIL|CUT|NOGPU|EMPTY) ' "$summary"
