#!/usr/bin/env bash
# The GPU issue's one prepared call: build for this GPU's architecture only, then each part
# under its own timeout, in this order (seconds: the issue's table, moved by the H200 run of
# 2026-11-27, whose b, d and e ran out of time and c used 57 of 100 s; QUICK_T_<PART>
# overrides):
#   a  15  bench/sdpa_probe.py: per aten SDPA op, GQA unexpanded, Sq < Sk causal alignment, lse
#   b 140  the GPU-only tests (-m gpu, 12 xdist workers, 100 s) and the offload CUDA tests (35 s)
#   c  60  bench/long_step.py: LLaMA-3-8B dims, 4 layers, S 128K, min_memory with and without
#          offload: peak and time, measured / modelled by ckpt_ext.plan
#   d 125  bench/attention.py --backend-rows: ckpt_ext's attention op with each backend pinned
#          (triton / flash / cuDNN / efficient) at S 32K and the layer's chunk shapes (the
#          first, a middle and the last chunk of LLaMA-3-8B's tiled layer at S 32K, its own
#          chunk rows; and 1,056 rows against 32K keys), each again packed (documents of 4,096
#          tokens as segment ids: flash's variable-length op against Triton), and the choice
#          table the times give (CKPT_EXT_AUTOTUNE=1 here only)
#   e  70  bench/lora_profile.py: LLaMA-3-8B layer, PEFT LoRA r 16, bf16, S 4096, one profiled
#          step per fused preset and HF's layer, top kernels
#   t 110  (not in the default list: --parts t, or with others, e.g. --parts bcet; the speed
#          issue's table) bench/speed.py: LLaMA-3-8B dims, 4 layers + head, bf16, B 1, at S 4K
#          and 16K (SPEED_SEQS): HF without checkpointing, HF checkpointing, HF checkpointing +
#          the fused loss, fast, balanced, min_memory, auto, each without and with PEFT LoRA
#          r 16: the median step time of 3 after a warm-up, the allocator's peak, OOM rows
#          kept, the goals (fast <= HF, min_memory <= HF checkpointing + fused loss, the LoRA
#          increments, auto <= the fastest HF row); its --deadline ends it 10 s before the
#          part's timeout with the table of what ran
#   f  55  bench/long_step.py: one 2-layer segment at S 256K, min_memory with offload and
#          streamed inputs (segment_layers=2, offload_stream=True): peak, host bytes and
#          time against the plan's (10 s moved from c, which used 57 s of 100 on the H200)
#   g  30  bench/demo.py with its defaults
#   h  20  reserve (not run: Triton compiles on a fresh machine overrun the parts; the
#          issue's table gives a 10 s and h 25 s: importing torch and starting CUDA and cuDNN
#          take a few seconds of a's)
#   s 150  (not in the default list: a part that waits for a second call, --parts s, on the
#          still-warm machine right after the first) bench/attention_bwd_sweep.py: the Triton
#          attention backward's launch configurations (tiles, warps, stages, register cap),
#          per kernel (dK/dV, dQ) at B 1, S 32K and at the layer's chunk shapes (282 and 1,056
#          rows against 32K keys), compiled by 16 workers (on small twins of the shapes: the
#          same kernels, off the timed GPU) while the main process times them, the winners
#          written as a winners file (kernels/attention_bwd_configs.json's format) and checked
#          together at B 1, S 32K. Its own --budget stops it 25 s before the part's timeout
#          with what it found. Device time: about 150 s plus the call's start-up (the build is
#          skipped when the tree's C++ sources are those of the CUDA build already there).
#   q  90  (not in the default list either: --parts q) bench/attention.py --providers
#          triton,triton_atomic,triton_ordered: the attention op's fwd, bwd and fwd+bwd at S 32K,
#          D 128, 32 query heads against 32 and 8 KV heads, causal, under each dQ setting
#          (separate: the default, 7 tile matmuls; atomic; ordered: 5 matmuls, deterministic,
#          not measured before), CKPT_EXT_AUTOTUNE=0: the first candidate that fits; then
#          triton_ordered again with CKPT_EXT_AUTOTUNE=1 (its kernel timed over every built-in
#          candidate that fits: no winner was ever measured for it)
#   m 100  (not in the default list either: the MoE issue's GPU row, --parts m, or --parts sm
#          with the sweep) bench/moe.py --layer: one Qwen3-30B-A3B layer (128 experts, top-k 8,
#          H 2048) at 32K tokens in bf16, HF's layer against the fused presets: forward+backward
#          time, peak, and the largest relative difference from HF's output, dx and router
#          gradient; beside Liger's 28.2 ms and 8.26 GB on an H100; then the same layer with
#          PEFT LoRA r 16 on the attention and the experts (--expert-lora-rank 16; the
#          difference over the output, dx and every adapter's gradient)
# CKPT_EXT_AUTOTUNE=0 except in part d. Files under $OUT (8 at most; each starts with device,
# versions, git commit, command and date): quick_0_summary.txt (environment, build log, the
# summary), quick_a_sdpa_probe.txt, quick_b_gpu_tests.txt, quick_cf_long_step.txt (c and f),
# quick_d_attention.txt, quick_e_lora_profile.txt, quick_g_demo.txt, quick_g_demo.png (part s:
# quick_s_attention_bwd.txt, quick_s_attention_bwd_configs.json; part m: quick_m_moe_layer.txt;
# part q: quick_q_dq_modes.txt; part t: quick_t_speed.txt). Parts whose files would pass 8
# together are refused (e.g. the default list and t: name the parts, e.g. --parts bcet).
# The one-screen summary is
# printed last.
#
#   OUT=$OUT bash tools/gpu_validate.sh quick              # on the device machine
#   OUT=$OUT bash tools/gpu_validate.sh quick --parts s    # the second call: the sweep
#   bash tools/gpu_validate.sh quick --dry-run             # on the CPU: tiny sizes, no build
#   (--parts LETTERS: those parts only, e.g. --parts bd to rerun two that broke; default abcdefg;
#   the parts run in the order listed above, not in the order of the letters)
#   (GPU_VALIDATE_DRY=1 does the same as --dry-run; tests/test_gpu_validate.py runs it)
#
# The dry run runs every part's own entry points at tiny sizes on the CPU (ATen kernels; the
# tests' Triton interpreter setting), skips the CUDA build (the installed package is used) and
# leaves bench/results alone. Exit status: 0 when every part ran to the end, 1 otherwise
# (a part's status is in the summary: ok, FAILED rc N, TIMEOUT, SKIPPED). QUICK_DEADLINE
# (575 s after the start) caps the last parts' timeouts, so that the summary prints inside the
# device tool's 600 s; the call's timeout_s should be 600.
set -uo pipefail
cd "$(dirname "$0")/.."
dry="${GPU_VALIDATE_DRY:-0}"
parts="abcdefg"
given="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --parts)
      parts="${2:-}"; shift
      if ! [[ "$parts" =~ ^[abcdefgmqst]+$ ]]; then
        echo "gpu_quick: --parts takes letters among abcdefgmqst, got '$parts'"; exit 2
      fi ;;
    *) echo "gpu_quick: unknown argument '$1' (only --dry-run, --parts LETTERS)"; exit 2 ;;
  esac
  shift
done
[ "$dry" = 0 ] || dry=1
# the files the parts return (the device tool returns 8 at most): the summary, and per part
n_files=1
for group in a:1 b:1 cf:1 d:1 e:1 g:2 s:2 m:1 q:1 t:1; do   # g: txt and png; s: txt and json
  [[ "$parts" == *[${group%%:*}]* ]] && n_files=$((n_files + ${group##*:}))
done
if [ "$n_files" -gt 8 ]; then
  echo "gpu_quick: --parts $parts would return $n_files files, more than the device tool's 8;" \
       "run fewer parts (e.g. --parts bcet)"; exit 2
fi
py="${PYTHON:-python3}"
out="${OUT:-bench/results/quick_$(date -u +%Y%m%d_%H%M)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CKPT_EXT_AUTOTUNE=0
start=$SECONDS
deadline="${QUICK_DEADLINE:-575}"   # seconds after the start; the dry run: none to speak of
[ "$dry" = 1 ] && deadline="${QUICK_DEADLINE:-100000}"
log() { echo "[gpu_quick $(date -u +%H:%M:%S) +$((SECONDS - start))s] $*"; }

if [ "$dry" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""          # the CPU paths, even on a machine with a GPU
  export TRITON_INTERPRET=1               # as tests/conftest.py sets it without a GPU
  device="CPU dry run ($(uname -m), $(nproc) cores): tiny sizes, NOT figures"
else
  device="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 \
            | head -1)"
fi
versions="$($py -c "
import sys, platform, torch
out = ['torch ' + torch.__version__, 'cuda ' + str(torch.version.cuda)]
for name in ('triton', 'transformers', 'peft'):
    try:
        out.append(name + ' ' + __import__(name).__version__)
    except Exception as exc:
        out.append(name + ' missing (' + type(exc).__name__ + ')')
print(', '.join(out + ['python ' + platform.python_version()]))
" 2>&1 | tail -1)"
# the device machine's copy of the tree may have no .git: QUICK_COMMIT=<hash> names it there
if [ -n "${QUICK_COMMIT:-}" ]; then
  commit="$QUICK_COMMIT (as the caller said)"
elif commit="$(git rev-parse --short HEAD 2>/dev/null)"; then
  git diff --quiet HEAD 2>/dev/null || commit="$commit+uncommitted changes"
else
  commit="unknown (no git here)"
fi

header() {   # header COMMAND...: the provenance lines each file starts with
  echo "# device: $device"
  echo "# versions: $versions"
  echo "# git: $commit"
  echo "# command: $*"
  echo "# date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
}

summary_file="$out/quick_0_summary.txt"
{ header "bash tools/gpu_validate.sh quick${given:+ $given}$([ "$dry" = 1 ] && [[ "$given" != *--dry-run* ]] && echo ' --dry-run')"
  echo "# OUT=$out CKPT_EXT_AUTOTUNE=0 (part d: 1)"
  [ "$dry" = 1 ] || nvidia-smi 2>&1
  command -v nvcc >/dev/null && nvcc --version | tail -2
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
} > "$summary_file"
cat "$summary_file"

# ---- build ---------------------------------------------------------------------------------
if [ "$dry" = 1 ]; then
  log "build skipped (dry run: no CUDA build on the CPU; the installed package is used)"
  $py -c "import ckpt_ext, ckpt_ext._C as C; print('ckpt_ext from', ckpt_ext.__file__, '| with_cuda', C.with_cuda)" \
      >> "$summary_file" 2>&1 || { log "ckpt_ext does not import"; exit 1; }
elif src_hash="$(find setup.py csrc -type f | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)"; \
     [ "${QUICK_BUILD:-auto}" = auto ] && [ -f build/quick_cuda_build.sha ] \
     && [ "$(cat build/quick_cuda_build.sha)" = "$src_hash" ] \
     && $py -c "import ckpt_ext; assert ckpt_ext._C.with_cuda" >/dev/null 2>&1; then
  # a warm machine's second call: the CUDA build of these very sources is already installed
  log "build skipped: the CUDA build of these C++ sources ($src_hash) is already installed"
  echo "== build skipped: the CUDA build of these sources ($src_hash) loads" >> "$summary_file"
else
  arch=$($py -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  log "build (CUDA extension, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch})"
  t0=$SECONDS
  echo "== build: TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}" >> "$summary_file"
  if ! TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" MAX_JOBS="${MAX_JOBS:-16}" \
      $py -m pip install --no-build-isolation --no-deps -e . >> "$summary_file" 2>&1; then
    tail -40 "$summary_file"; log "build FAILED"; exit 1
  fi
  $py -c "import ckpt_ext; assert ckpt_ext._C.with_cuda, 'not a CUDA build'; print('CUDA build loaded')" \
      >> "$summary_file" 2>&1 || { tail -5 "$summary_file"; log "build does not load"; exit 1; }
  mkdir -p build && echo "$src_hash" > build/quick_cuda_build.sha
  log "build done in $((SECONDS - t0)) s"
fi
parts_start=$SECONDS

# ---- the parts -----------------------------------------------------------------------------
declare -a status_lines=()
failed=0
part() {   # part ID SECONDS FILE TITLE SCRIPT: SCRIPT (bash) under `timeout SECONDS`
  local id=$1 secs=$2 file="$out/$3" title=$4 script=$5 rc t0=$SECONDS
  [[ "$parts" == *"$id"* ]] || return 0    # not among --parts
  local var="QUICK_T_${id^^}"
  secs="${!var:-$secs}"
  # the dry run: the same timeouts would measure the CPU's load, not the script (part d times
  # three dQ modes: about a minute on two quiet cores, past 150 s on a loaded machine)
  [ "$dry" = 1 ] && secs="${QUICK_DRY_TIMEOUT:-300}"
  # the call's own deadline (the device tool stops a command at 600 s): a slow build or an
  # overrun shortens the last parts, and the summary still prints
  local left=$(( deadline - (SECONDS - start) - 20 ))
  if [ "$left" -lt 5 ]; then
    status_lines+=("$(printf '%s %-9s %4d/%3d s  %-40s %s' "$id" "SKIPPED" 0 "$secs" "$title" \
                      "(deadline: ${deadline} s after the start)")")
    log "part $id skipped: the ${deadline} s deadline is near"; failed=1; return
  fi
  [ "$secs" -gt "$left" ] && secs=$left
  log "part $id ($secs s): $title"
  [ -s "$file" ] && echo >> "$file"
  { header "$script"; echo "# part $id: $title (timeout $secs s)"; } >> "$file"
  PART_SECS=$secs timeout -k 10 "$secs" bash -c "$script" >> "$file" 2>&1
  rc=$?
  local what="ok"
  if [ $rc = 124 ] || [ $rc = 137 ]; then what="TIMEOUT"; failed=1
  elif [ $rc != 0 ]; then what="FAILED rc $rc"; failed=1; fi
  echo "# part $id: $what after $((SECONDS - t0)) s" >> "$file"
  status_lines+=("$(printf '%s %-9s %4d/%3d s  %-40s %s' "$id" "$what" $((SECONDS - t0)) "$secs" \
                    "$title" "$(basename "$file")")")
  log "part $id: $what after $((SECONDS - t0)) s"
}

# The GPU's arguments; the dry run passes the same ones with tiny sizes after them (argparse
# takes the last), so that a renamed or mistyped flag fails here on the CPU too.
long_model="--device cuda --dtype bfloat16 --hidden 4096 --intermediate 14336 --heads 32"
long_model="$long_model --kv-heads 8 --vocab 128256 --warmup-seq 4096"
c_args="$long_model --layers 4 --seq ${LONG_SEQ:-131072} --setups min_memory min_memory+offload"
f_args="$long_model --layers 2 --seq ${LAYER_SEQ:-262144}"
f_args="$f_args --setups min_memory+offload+stream+seg2"
probe_args="" e_args="" demo_args=""
workers=""
$py -c "import xdist" 2>/dev/null && workers="-n ${TEST_WORKERS:-12}"
if [ "$dry" = 1 ]; then
  workers=""
  tiny_model="--device cpu --dtype float32 --hidden 64 --intermediate 128 --heads 4"
  tiny_model="$tiny_model --kv-heads 2 --vocab 256"
  probe_args="--seq 32 --head-dim 16"
  c_args="$c_args $tiny_model --layers 2 --seq 128 --warmup-seq 32"
  f_args="$f_args $tiny_model --seq 256 --warmup-seq 32"
  e_args="--hidden 64 --heads 4 --kv-heads 2 --intermediate 128 --seq 32 --lora 4"
  e_args="$e_args --warmup 0 --reps 1 --top 5"
fi
# The demo: its defaults on the GPU, its outputs into a folder of this run (then into $OUT);
# its flags change (the front-door issue): the dry run passes the tiny sizes it lists in --help.
demo_dir=$(mktemp -d)
grep -q -- '"--out"' bench/demo.py && demo_args="--out $demo_dir"
if [ "$dry" = 1 ]; then
  demo_help=$($py bench/demo.py --help 2>&1)
  for pair in "--device cpu" "--layers 2" "--hidden 32" "--heads 4" "--kv-heads 2" \
              "--intermediate 64" "--vocab 128" "--seq 32" "--seqs 24,40" "--batch 1" \
              "--steps 1" "--warmup 1" "--presets none min_memory"; do
    grep -qE -- "(^|[^a-z-])${pair%% *}([ ,=]|\$)" <<<"$demo_help" && demo_args="$demo_args $pair"
  done
fi
gpu_files=$(grep -l "mark\.gpu" tests/test_*.py | tr '\n' ' ')
stamp=$(mktemp)

part a 15 quick_a_sdpa_probe.txt "probe: aten SDPA ops (GQA, Sq<Sk, lse)" \
  "$py bench/sdpa_probe.py $probe_args"
part b 140 quick_b_gpu_tests.txt "GPU-only tests and offload CUDA tests" \
  "r=0; timeout ${QUICK_T_B_GPU:-100} $py -m pytest -v -ra -p no:cacheprovider $workers -m gpu $gpu_files || r=\$?
   echo '# offload CUDA tests'
   timeout ${QUICK_T_B_OFFLOAD:-35} $py -m pytest -v -ra -p no:cacheprovider tests/test_offload.py -k cuda || r=\$?
   exit \$r"
part c 60 quick_cf_long_step.txt "LLaMA-3-8B x4, S 128K, min_memory +-offl." \
  "$py bench/long_step.py $c_args"
# q: the Triton attention under each dQ setting at S 32K (the dry run: the CPU smoke size)
q_args="--providers triton,triton_atomic,triton_ordered --seqlens 32768 --tokens 32768"
q_args="$q_args --head-dims 128 --heads 128:32 --gqa-seqlen 32768 --mask-seqlen 0 --warmup 2"
q_args="$q_args --reps 5"
[ "$dry" = 1 ] && q_args="$q_args --cpu-size 1,2,32,16 --warmup 0 --reps 1"
q_dir=$(mktemp -d)
part q 90 quick_q_dq_modes.txt "attention dQ settings: separate, atomic, ordered" \
  "$py bench/attention.py $q_args --out $q_dir/attention_dq_modes.csv; r=\$?
   cat $q_dir/attention_dq_modes.csv
   echo '# triton_ordered autotuned (CKPT_EXT_AUTOTUNE=1)'
   CKPT_EXT_AUTOTUNE=1 $py bench/attention.py $q_args --providers triton_ordered \
     --out $q_dir/attention_ordered_tuned.csv; r2=\$?
   cat $q_dir/attention_ordered_tuned.csv; [ \$r = 0 ] && exit \$r2; exit \$r"
rm -rf "$q_dir"
att_dir=$(mktemp -d)
# the attention routing's own bench: ckpt_ext's op with each backend pinned (merges included)
# at the layer's call shapes, and the choice table the times give
d_script="$py bench/attention.py --backend-rows --backends triton,flash,cudnn,efficient \
  --backend-shape 1,32,8,128 --backend-seqlens 32768 --chunk-rows 1056 --chunk-keys 32768 \
  --layer-dims 4096,32,8,128,14336 --layer-seqlens 32768 --backend-packed-doc 4096 \
  --warmup 2 --reps 5 --out $att_dir/attention_backends.csv --write-table $att_dir/table.json"
[ "$dry" = 1 ] && d_script="$d_script --backend-shape 1,4,2,16 --backend-seqlens 64 \
  --chunk-rows 16 --chunk-keys 64 --layer-dims 64,4,2,16,128 --layer-seqlens 64 \
  --chunk-bytes 16384 --backend-packed-doc 24 --warmup 0 --reps 1"
d_script="$d_script; r=\$?; cat $att_dir/attention_backends.csv $att_dir/table.json; exit \$r"
part d 125 quick_d_attention.txt "attention per backend, whole, chunks, packed" \
  "export CKPT_EXT_AUTOTUNE=1; $d_script"
part e 70 quick_e_lora_profile.txt "LoRA profile: LLaMA-3-8B layer, r 16" \
  "$py bench/lora_profile.py $e_args"
# t: the speed table (the speed issue's), its CSV appended to the part's file
t_dir=$(mktemp -d)
t_args="--seqs ${SPEED_SEQS:-4096,16384} --warmup 1 --reps 3"
[ "$dry" = 1 ] && t_args="$t_args --dry-run"
part t 110 quick_t_speed.txt "speed table: HF vs presets, S 4K/16K, +LoRA" \
  "$py bench/speed.py $t_args --deadline \$((PART_SECS - 10)) --out $t_dir/speed.csv; r=\$?
   cat $t_dir/speed.csv; exit \$r"
rm -rf "$t_dir"
part f 55 quick_cf_long_step.txt "2-layer segment, S 256K, streamed offload" \
  "$py bench/long_step.py $f_args"
part g 30 quick_g_demo.txt "demo (its defaults)" \
  "$py bench/demo.py $demo_args; r=\$?
   for f in \$(find $demo_dir -maxdepth 1 -name 'demo_*.csv' -newer $stamp); do echo \"# \$f\"; cat \"\$f\"; done
   exit \$r"
# s: the attention backward sweep (the second call's part); its --budget ends it 25 s before
# the part's timeout ($PART_SECS), with the winners found so far written
s_json="$out/quick_s_attention_bwd_configs.json"
s_args="--out $s_json --commit '${commit}'"
[ "$dry" = 1 ] && s_args="$s_args --device cpu --dtype fp32 --shape 1,2,1,16 --buckets 48:48,16:48 \
  --block-m 32 --block-n 32,64 --warps 4 --limit 2 --reps 1 --top 2 --check-seq 40 --jobs 1"
part s 150 quick_s_attention_bwd.txt "attention backward sweep (tiles, warps...)" \
  "$py bench/attention_bwd_sweep.py --budget \$((PART_SECS - 25)) $s_args"
# m: the MoE layer (the MoE issue's GPU row), then with expert LoRA r 16 (the dry run: r 4),
# each CSV appended to the part's file
m_dir=$(mktemp -d)
m_args="--layer --tokens 32768 --reps 3"
m_rank=16
[ "$dry" = 1 ] && m_args="--layer --device cpu --layer-shape 64,8,2,32,4,2,16 --tokens 96 --reps 1" \
  && m_rank=4
part m 100 quick_m_moe_layer.txt "MoE layer: Qwen3-30B-A3B, 32K tokens, HF vs fused (+LoRA)" \
  "$py bench/moe.py $m_args --out $m_dir/moe_layer.csv; r=\$?; cat $m_dir/moe_layer.csv
   $py bench/moe.py $m_args --expert-lora-rank $m_rank --out $m_dir/moe_layer_lora.csv; \
   r2=\$?; cat $m_dir/moe_layer_lora.csv; [ \$r = 0 ] && exit \$r2; exit \$r"
rm -rf "$m_dir"
png=$(find "$demo_dir" -maxdepth 1 -name 'demo_*.png' -newer "$stamp" 2>/dev/null | head -1)
[ -n "$png" ] && cp "$png" "$out/quick_g_demo.png"
rm -rf "$demo_dir"
rm -rf "$stamp" "$att_dir"

# ---- the summary: one screen ---------------------------------------------------------------
{
  echo
  echo "================ gpu_validate quick: summary ($device; $commit)"
  echo "parts took $((SECONDS - parts_start)) s after the build (budget 495 s); all $((SECONDS - start)) s"
  printf '%s\n' "${status_lines[@]}"
  has() { [[ "$parts" == *"$1"* ]]; }   # a part among --parts
  if has a; then
    echo "-- a: GQA unexpanded / Sq<Sk causal alignment"
    grep -E "^(flash|cudnn|efficient|flash_varlen|efficient_varlen|varlen_attn) +(gqa|causal_sq<sk) " \
        "$out/quick_a_sdpa_probe.txt" | cut -c1-110
  fi
  if has b; then
    echo "-- b: tests"
    grep -E "(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s" \
        "$out/quick_b_gpu_tests.txt" | cut -c1-110
    grep -E "^(FAILED|ERROR) " "$out/quick_b_gpu_tests.txt" | head -8 | cut -c1-150
  fi
  if has c || has f; then
    echo "-- c/f: measured / modelled"
    grep -E "(peak|step) .*(modelled|TFLOP/s)|OOM|offload/none" "$out/quick_cf_long_step.txt" \
        | cut -c1-150
  fi
  if has q; then
    echo "-- q: TFLOP/s (fwd bwd f+b) per dQ setting: triton (separate) | atomic | ordered"
    grep -E "^ +[0-9]+ +[0-9]+/[0-9]+ " "$out/quick_q_dq_modes.txt" | cut -c1-150
  fi
  if has d; then
    echo "-- d: f+b TFLOP/s per shape (rel err vs ops)"
    grep -E "^shape " "$out/quick_d_attention.txt" | cut -c1-150
  fi
  if has e; then
    echo "-- e: LoRA"
    grep -E "^(step ms|LoRA increment|goal)" "$out/quick_e_lora_profile.txt" | cut -c1-150
  fi
  if has t; then
    echo "-- t: speed table (step ms, peak MiB; B 1, 4 layers + head), goals"
    grep -E "^== S |^ *[a-z_+@]+ +(ok|OOM|no fit|skipped)|^goal S=" "$out/quick_t_speed.txt" \
      | cut -c1-150
  fi
  if has g; then
    echo "-- g: demo"
    grep -v "^#" "$out/quick_g_demo.txt" | tail -7 | cut -c1-150
  fi
  if has s; then
    echo "-- s: attention backward sweep (winner / baseline; check at B 1, whole S)"
    grep -E "^(winner|check .*(winners|=)|budget|wrote) " "$out/quick_s_attention_bwd.txt" \
      | cut -c1-150
  fi
  if has m; then
    echo "-- m: MoE layer (fwd+bwd, peak, rel err vs HF; Liger's goal), then with expert LoRA"
    grep -E "^ *(hf|fast|balanced|min_memory): |^goal |one Qwen3-MoE layer.*LoRA r " \
      "$out/quick_m_moe_layer.txt" | cut -c1-150
  fi
  echo "files: $(cd "$out" && ls | tr '\n' ' ')"
} > "$out/.summary"
cat "$out/.summary" >> "$summary_file"
cat "$out/.summary"
rm -f "$out/.summary"
exit $failed
