#!/usr/bin/env bash
# The GPU checks in one run, under 8 minutes, on a GPU machine: the report,
# the staged path's primitives with device tensors (ranks sharing the
# GPU), the multi-rank specs with device tensors over MPI and over NCCL's
# backend with the NCCL test double (spec/gpu/multirank_spec.lua), the
# rest of the GPU suite (spec/gpu, every example among it), GPT-2's main
# bench/gpu.sh row against PyTorch, and bench/staged.sh. Each part runs
# under its own time limit, cut to what is left of 450 s; its log and a
# line in summary.txt go under $OUT (default: device_check/);
# DEVICE_CHECK_SECONDS changes the 450.
#
# Here: scripts/build.sh (a CUDA build: nvcc), then from the project root
#   ../shared/device/bundle.sh
# There (carry .device and build/libnccl_double.so):
#   bash scripts/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-device_check}
mkdir -p "$out"
# shellcheck disable=SC1091  # made by ../shared/device/bundle.sh
if [[ -f .device/env.sh ]]; then . .device/env.sh; fi
busted=${BUSTED:-/usr/bin/busted}
summary=$out/summary.txt
: > "$summary"
start=$(date +%s)
budget=${DEVICE_CHECK_SECONDS:-450}

# part NAME SECONDS COMMAND...: runs it with its log in $out/NAME.log and
# writes its exit status, time and busted's tally (or last line) to the summary
part() {
    local name=$1 limit=$2 left t0 rc tally
    shift 2
    left=$((budget - ($(date +%s) - start)))
    if ((left < 10)); then
        printf '%-22s skipped: the %d s budget is spent\n' "$name" "$budget" | tee -a "$summary"
        return
    fi
    ((limit > left)) && limit=$left
    t0=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    tally=$(grep -E '^[0-9]+ successes? / ' "$out/$name.log" | tail -1)
    [[ -z $tally ]] && tally=$(tail -1 "$out/$name.log")
    ((rc == 124)) && tally="timed out after $limit s; $tally"
    printf '%-22s rc=%-3s %4d s  %s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$tally" | tee -a "$summary"
}

gpu=(build/dslua "$busted" --tags=gpu --exclude-tags=none)
other=()
for f in spec/gpu/*_spec.lua; do [[ $f == */multirank_spec.lua ]] || other+=("$f"); done

part report 10 build/dslua --report
part staged_primitives 50 "${gpu[@]}" --filter='primitive' spec/gpu/multirank_spec.lua
# the two paths side by side: one thread a rank, 2-4 ranks each, one GPU
part multirank_mpi 240 "${gpu[@]}" --filter='over MPI %(staged%)' spec/gpu/multirank_spec.lua &
part multirank_nccl_double 240 "${gpu[@]}" --filter='over NCCL %(the test double%)' spec/gpu/multirank_spec.lua &
wait
part gpu_suite 60 "${gpu[@]}" "${other[@]}"
part bench_gpt2_dslua 20 build/dslua bench/gpu.lua train 8 bf16 50304
part bench_gpt2_torch 20 python3 bench/gpu_torch.py train 8 bf16 50304
part bench_staged 20 bash bench/staged.sh -q
grep -h '^result' "$out"/bench_*.log >> "$summary" 2>/dev/null
echo "total $(($(date +%s) - start)) s" | tee -a "$summary"
