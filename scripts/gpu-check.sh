#!/usr/bin/env bash
# The CUDA backend's check on a machine with a GPU, in under 8 minutes. It needs no Rust:
# give it an autopar binary built elsewhere (`cargo build --release`; the CUDA backend is
# always compiled in and loads its libraries at run time).
#
#   scripts/gpu-check.sh [path/to/autopar]      (default: target/release/autopar)
#
# It prints one table: --verify rows (gpt-tiny, llama-tiny, moe-tiny; one rank and
# dp=2,tp=2 on one GPU; f32 and bf16), kernel figures (bf16 GEMM 8192^3 and attention
# fwd+bwd against the GPU's peak, a fused element-wise kernel against the copy bandwidth),
# a GPT-2-small training step in tokens/s against PyTorch eager and torch.compile (the
# twin script gpu_check_torch.py, same model, bf16, batch 8, seq 1024), its peak memory
# (nvidia-smi) against the plan's, and NCCL all-reduce bus bandwidth with several GPUs.
set -u
BIN=${1:-target/release/autopar}
HERE=$(cd "$(dirname "$0")" && pwd)
DEADLINE=$((SECONDS + 470))
if [ ! -x "$BIN" ]; then
  echo "gpu-check: no autopar binary at $BIN (build it with cargo build --release)" >&2
  exit 2
fi
# The CUDA libraries of the pip wheels (NVRTC, cuBLAS, NCCL), when the system has none.
SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
for d in "$SITE/nvidia/cu13/lib" "$SITE/nvidia/nccl/lib" "$SITE"/nvidia/*/lib; do
  [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH
ROWS=()
row() { ROWS+=("$(printf '%-58s | %-28s | %s' "$1" "$2" "$3")"); }
left() { echo $((DEADLINE - SECONDS)); }
bounded() { local t=$1; shift; [ "$(left)" -gt 5 ] || return 124; timeout "$(( t < $(left) ? t : $(left) ))" "$@"; }

# 1. Verify against the CPU reference.
for model in gpt-tiny llama-tiny moe-tiny; do
  for mesh in dp=1 dp=2,tp=2; do
    for dtype in f32 bf16; do
      out=$(bounded 60 "$BIN" run "$model" --device cuda --steps 3 --mesh "$mesh" --dtype "$dtype" --verify 2>&1)
      rc=$?
      line=$(grep -m1 '^verify:' <<<"$out" || tail -n1 <<<"$out")
      [ $rc -eq 0 ] && status=OK || status="FAILED (exit $rc)"
      row "verify $model $mesh $dtype" "$status" "$line"
    done
  done
done

# 2. Kernel figures.
if out=$(bounded 120 "$BIN" bench-kernels --device cuda 2>&1); then
  while IFS=$'\t' read -r name value against; do
    row "$name" "$value" "$against"
  done <<<"$out"
else
  row "bench-kernels" "FAILED" "$(tail -n1 <<<"$out")"
fi

# 3. GPT-2 small: tokens/s from the difference of a 2-step and a 7-step run (compile, load
# and the first step cancel), peak memory sampled with nvidia-smi against the plan's.
GPT2="gpt:layers=12,hidden=768,heads=12,seq=1024,vocab=50304"
run_steps() {
  local t0; t0=$(date +%s.%N)
  bounded 150 "$BIN" run "$GPT2" --batch 8 --dtype bf16 --device cuda --steps "$1" >"/tmp/gpu-check-gpt2-$1.txt" 2>&1
  local rc=$?; local t1; t1=$(date +%s.%N)
  echo "$rc $(echo "$t1 - $t0" | bc)"
}
SMI_LOG=/tmp/gpu-check-smi.txt
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$SMI_LOG" 2>/dev/null &
SMI_PID=$!
BASE=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n1)
read -r rc2 t2 <<<"$(run_steps 2)"
read -r rc7 t7 <<<"$(run_steps 7)"
kill "$SMI_PID" 2>/dev/null
if [ "$rc2" = 0 ] && [ "$rc7" = 0 ]; then
  step=$(echo "($t7 - $t2) / 5" | bc -l)
  ours=$(echo "8 * 1024 / $step" | bc -l)
  row "GPT-2 small step, bf16, batch 8 (autopar)" "$(printf '%.0f tokens/s' "$ours")" "$(printf 'step %.3f s' "$step")"
  planned=$(grep -m1 'peak memory' /tmp/gpu-check-gpt2-7.txt | sed 's/.*peak memory[^0-9]*//')
  peak=$(sort -n "$SMI_LOG" 2>/dev/null | tail -n1)
  row "GPT-2 small peak memory" "$(( ${peak:-0} - ${BASE:-0} )) MiB measured" "planned: $planned"
else
  ours=""
  row "GPT-2 small step (autopar)" "FAILED" "$(tail -n1 /tmp/gpu-check-gpt2-7.txt)"
fi
if torch_out=$(bounded 200 python3 "$HERE/gpu_check_torch.py" gpt2 2>&1); then
  while read -r mode tps; do
    ratio=""
    [ -n "$ours" ] && ratio=$(printf 'autopar = %.2fx' "$(echo "$ours / $tps" | bc -l)")
    row "GPT-2 small step, bf16, batch 8 (PyTorch $mode)" "$(printf '%.0f tokens/s' "$tps")" "$ratio"
  done <<<"$(grep -E '^(eager|compile) ' <<<"$torch_out")"
else
  row "GPT-2 small (PyTorch)" "FAILED" "$(tail -n1 <<<"$torch_out")"
fi

# 4. NCCL all-reduce bus bandwidth (several GPUs only).
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$GPUS" -gt 1 ]; then
  if out=$(bounded 90 python3 "$HERE/gpu_check_torch.py" allreduce 2>&1); then
    row "NCCL all-reduce, $GPUS GPUs, 256 MiB" "$(grep -m1 busbw <<<"$out" | awk '{print $2, $3}')" "torch.distributed (NCCL)"
  else
    row "NCCL all-reduce" "FAILED" "$(tail -n1 <<<"$out")"
  fi
else
  row "NCCL all-reduce" "skipped" "one GPU"
fi

printf '%-58s | %-28s | %s\n' "check" "result" "detail"
printf '%s\n' "$(printf -- '-%.0s' $(seq 1 110))"
printf '%s\n' "${ROWS[@]}"
