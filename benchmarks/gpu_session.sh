#!/usr/bin/env bash
# The GPU figures docs/time_to_loss.md and docs/serve.md still wait for, measured in order of value inside a time
# budget: one short lease of a GPU machine measures what matters most first, and says what it skipped.
#
#   KIT=.gpu OUT=results BUDGET=570 bash benchmarks/gpu_session.sh first
#   KIT=.gpu OUT=results BUDGET=300 bash benchmarks/gpu_session.sh rest     # then, with what time is left
#
# KIT     a folder with nanogpt/ (a checkout of karpathy/nanoGPT), tinyshakespeare.txt and, for a machine with no
#         package index, wheels/ (benchmarks/offline_wheels.py; only those not installed there are installed)
# OUT     where the figures come back: OUT/HALF.txt (each step's digest) and OUT/HALF.tgz (every log and JSON)
# BUDGET  seconds this call may take; a step that does not fit in what is left is skipped, and says so
# BEST    (rest) NAME=FLAGS of the recipe variant to run again cold; default: the first half's best, read from
#         its results where the machine still holds them (STATE, default /tmp/gpu_session)
# DRY=1   the same plan on the CPU at tiny sizes: the script's own check (its figures mean nothing)
#
# first: the imports with minigpt's bytecode cache off and on, and where they go; the recipe cold as shipped and
#        under --compile_mode graphed (alone, with the replayed update, and in 8 s); the GPU tests of the CUDA-graph
#        modes; the replayed update alone; a wider model; the server over HTTP, one client, GPT-2 124M (its step
#        compiled and captured for each batch bucket before it answers). The runs after the first step read the
#        bytecode cache it made.
# rest:  (on a fresh machine, the bytecode cache first) the best 12 s variant again cold; the 40 s candidate for the
#        120 s goal; the serve engine's token, each way, and under cProfile; the server with its step uncompiled;
#        throughput on the 124M shape against nanoGPT's bench.py; the step's host overhead per compile mode, with a
#        profile; the rest of the GPU tests.
set -uo pipefail
cd "$(dirname "$0")/.."
HALF=${1:?first or rest}
KIT=$(realpath "${KIT:?a folder with nanogpt/, tinyshakespeare.txt and wheels/}")
OUT=${OUT:?where the results go} BUDGET=${BUDGET:-570} DRY=${DRY:-0}
STATE=${STATE:-/tmp/gpu_session} # kept between the halves while the machine is
rm -rf "${STATE:?}/$HALF"
mkdir -p "$OUT" "$STATE/$HALF"
START=$SECONDS
DIGEST="$OUT/$HALF.txt"

say() { echo "$*" | tee -a "$DIGEST"; }
left() { echo $((BUDGET - (SECONDS - START))); }
pack() { tar -czf "$OUT/$HALF.tgz" -C "$STATE" "$HALF" 2>/dev/null; }

# step NAME NEED LIMIT CMD...: CMD, its output in STATE/HALF/NAME.log, if NEED seconds are left; stopped at LIMIT
# seconds or at what is left; then its digest (digest NAME) and the results packed, so a cut run still returns them
step() {
    local name=$1 need=$2 limit=$3 rest
    shift 3
    rest=$(left)
    if ((rest < need)); then
        say "== $name: skipped, ${rest}s left of the ${need}s it needs"
        return
    fi
    ((limit > rest - 5)) && limit=$((rest - 5))
    say "== $name (${rest}s left, at most ${limit}s)"
    local begun=$SECONDS
    timeout -k 5 "$limit" "$@" >"$STATE/$HALF/$name.log" 2>&1
    say "   rc $? in $((SECONDS - begun))s"
    digest "$name" | tee -a "$DIGEST"
    pack
}

digest() { # a few lines per step: what to read first
    local log="$STATE/$HALF/$1.log"
    case $1 in
    tests*) # -v: each test's line as it ends, so a step cut at its limit still says which passed
        printf '   per test: %s passed, %s failed, %s skipped\n' "$(grep -c ' PASSED' "$log")" \
            "$(grep -c -E ' (FAILED|ERROR)' "$log")" "$(grep -c ' SKIPPED' "$log")"
        grep -E "^(FAILED|ERROR)| (FAILED|ERROR) |passed|failed" "$log" | tail -n 12
        ;;
    variant_*)
        python3 - "$STATE/$HALF/$1.json" <<'EOF'
import json, sys
try:
    row = json.load(open(sys.argv[1]))["minigpt"][0]
except Exception as error:
    sys.exit(print("   no result:", error))
keys = "rc first_step_s startup compile_s not_compiled steps full_val full_val_at_s best_full_val best_step".split()
print("  ", {k: row[k] for k in keys if k in row})
print("   curve (s since launch, step, val):", row["curve"])
print("   tail:", row.get("tail", "")) if row["rc"] else None
EOF
        ;;
    bytecode)
        python3 - "$STATE/$HALF/bytecode.json" <<'EOF'
import json, sys
try:
    launches = json.load(open(sys.argv[1]))["bytecode"]
except Exception as error:
    sys.exit(print("   no result:", error))
for name, row in launches.items():
    if name != "environment":
        keys = "rc launch_to_exit_s imports_s pyc_files torch_cached_here cpu_capability tail".split()
        print(f"   {name}:", {k: row[k] for k in keys if k in row})
for key, top in launches.get("next, -X importtime", {}).get("breakdown", {}).items():
    print(f"   {key}:", top)
EOF
        ;;
    *) grep -v -E "^\s*$|Warning|warn\(" "$log" | tail -n 14 ;;
    esac
}

WITHOUT=torchvision,transformers,scipy,torchaudio # minigpt's runs as a fresh install: what Lightning's import pulls in

# the imports took ~10 s there against ~3 s on a 2-core CPU, warm or cold, as when Python compiles every module from
# source at each launch (an image with no .pyc files, and none written): train.py's imports with minigpt's bytecode
# cache off, then its first launch (writes the cache) and the next (reads it), through the recipe runs' interpreter
# and site folder, so that the variants after it read that cache as a user's second launch would; then the next
# once more under -X importtime: where the time goes by package and module, whatever the cache changed
bytecode() {
    step bytecode 60 140 python3 benchmarks/bench_gpu.py "${GPU_ARGS[@]}" --without $WITHOUT --parts bytecode \
        --work "$STATE/work" --out "$STATE/$HALF/bytecode.json"
}

variant() { # variant NAME FLAGS...: the GPU recipe once with these train.py flags, cold (its own compile caches)
    local name=$1 timeout=${VARIANT_TIMEOUT:-62}
    shift
    [[ $* == *max_time\ 00:00:00:40* ]] && timeout=95
    step "variant_$name" $((timeout + 5)) $((timeout + 30)) python3 benchmarks/bench_gpu.py "${GPU_ARGS[@]}" \
        --without $WITHOUT --parts variants --timeout "$timeout" \
        --work "$STATE/work" --out "$STATE/$HALF/variant_$name.json" --variant "$name=$*"
}

# a machine with no package index: the carried wheels that are not installed there, into a folder of their own
if [[ -d $KIT/wheels ]]; then
    mapfile -t wheels < <(python3 - "$KIT"/wheels/*.whl <<'EOF'
import importlib.metadata as md, sys
for path in sys.argv[1:]:
    try:
        md.version(path.rsplit("/", 1)[-1].split("-")[0])
    except md.PackageNotFoundError:
        print(path)
EOF
    )
    if ((${#wheels[@]})); then
        # all at once; where one does not install (another Python's wheel), each on its own, and the digest names it
        python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/minigpt_site "${wheels[@]}" ||
            for wheel in "${wheels[@]}"; do
                python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/minigpt_site "$wheel" ||
                    say "wheel not installed: ${wheel##*/}"
            done
        export PYTHONPATH=/tmp/minigpt_site${PYTHONPATH:+:$PYTHONPATH}
    fi
fi
GPU_ARGS=(--nanogpt "$KIT/nanogpt" --corpus "$KIT/tinyshakespeare.txt")
DEVICE=cuda
WIDE=(--model.n_layer 8 --model.n_embd 512 --model.n_head 8) # the step is the host's: a wider model costs little more
if ((DRY)); then
    GPU_ARGS+=(--device cpu --tiny)
    DEVICE=cpu
    WIDE=(--model.n_layer 2 --model.n_embd 64 --model.n_head 2)
fi
QUICK=$( ((DRY)) && echo --quick)
{
    date -u
    git log --oneline -1 2>/dev/null
    nvidia-smi -L 2>/dev/null
    # the versions installed, not imported: importing torch and Lightning took seconds on the GPU machine
    python3 -c "import sys; from importlib.metadata import version as v; print(sys.version.split()[0], v('torch'), v('lightning'))"
} 2>&1 | tee -a "$DIGEST"

if [[ $HALF == first ]]; then
    bytecode
    variant shipped
    variant graphed --compile_mode graphed
    variant graphed_graph --compile_mode graphed --optim.cuda_graph true
    variant graphed_graph_8s --compile_mode graphed --optim.cuda_graph true --trainer.max_time 00:00:00:08
    # -o addopts=-v: in one process, without pyproject's `-n 2`, each test's outcome on its own line
    step tests_graphed 60 120 python3 -m pytest -p no:cacheprovider -o addopts=-v -m gpu tests/gpu \
        -k "graphed or replayed or move or sync or dropout"
    variant graph --optim.cuda_graph true
    variant wide_12s "${WIDE[@]}"
    step serve_http 60 150 python3 benchmarks/bench_serve.py $QUICK --device $DEVICE --shapes 124m --clients 1 \
        --json "$STATE/$HALF/serve_http.json"
else
    if [[ -z ${BEST:-} ]] && compgen -G "$STATE/first/variant_*.json" >/dev/null; then # the earliest at <= 1.47,
        # else the lowest loss (all of them 12 s or less)
        BEST=$(python3 - "$STATE"/first/variant_*.json <<'EOF'
import json, sys
rows = []
for path in sys.argv[1:]:
    row = json.load(open(path))["minigpt"][0]
    if row["rc"] == 0 and "full_val" in row:
        rows.append(row)
if rows:
    good = [r for r in rows if r["full_val"] <= 1.47]
    best = min(good, key=lambda r: r["full_val_at_s"]) if good else min(rows, key=lambda r: r["full_val"])
    print(best["name"].removeprefix("variant_") + "_again=" + best["overrides"])
EOF
        )
    fi
    BEST=${BEST:-shipped_again=}
    say "again: $BEST"
    [[ -d $STATE/first ]] || bytecode # a fresh machine: its bytecode cache made before the runs that read it
    variant "${BEST%%=*}" ${BEST#*=}
    variant wide_40s "${WIDE[@]}" --model.dropout 0.3 --trainer.max_time 00:00:00:40
    step engine 40 120 python3 benchmarks/bench_engine.py $QUICK --device $DEVICE --shapes 124m \
        --json "$STATE/$HALF/engine.json"
    step engine_cprofile 30 60 python3 benchmarks/bench_engine.py $QUICK --device $DEVICE --shapes 124m \
        --ways "static, eager" --repeat 1 --cprofile --json "$STATE/$HALF/engine_cprofile.json"
    step serve_eager 30 60 python3 benchmarks/bench_serve.py $QUICK --device $DEVICE --shapes 124m --clients 1 \
        --compile false --json "$STATE/$HALF/serve_eager.json"
    step throughput 90 180 python3 benchmarks/bench_gpu.py "${GPU_ARGS[@]}" --parts throughput --timeout 80 \
        --compile_kinds regions,whole,whole+max-autotune-no-cudagraphs --work "$STATE/work_tp" \
        --out "$STATE/$HALF/throughput.json"
    runs=muon:train_py:regions+cudagraphs,muon+graph:train_py:regions+cudagraphs,muon:train_py:whole+graphed
    runs+=,muon+graph:train_py:whole+graphed,muon+graph:train_py:whole+cudagraphs
    step overhead 60 120 python3 benchmarks/bench_gpu.py "${GPU_ARGS[@]}" --parts overhead --timeout 110 \
        --overhead_runs "$runs" --profile muon+graph:train_py:whole+graphed --work "$STATE/work_overhead" \
        --out "$STATE/$HALF/overhead.json"
    step tests_rest 60 300 python3 -m pytest -p no:cacheprovider -o addopts=-v -m gpu tests/gpu \
        -k "not (graphed or replayed or move or sync or dropout)"
fi
say "== $HALF done: $((SECONDS - START))s of $BUDGET"
pack
