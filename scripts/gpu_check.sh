#!/usr/bin/env bash
# The GPU check: meshd on --device cuda against transformers' generate on the same GPU (the tiny
# architecture matrix in float32 and bfloat16, a golden two-node mesh, a GPU+CPU mesh) and bench rows.
# Two steps, because a GPU machine lent through the device tool reaches no package index and takes
# at most 64 MiB of files (the built-in model's GGUF is 94 MB: the check uses random-weight models
# with the built-in tokenizer instead):
#   scripts/gpu_check.sh prepare   # here: Python 3.12 wheels of what its image lacks, and the tokenizer
#   scripts/gpu_check.sh run       # there, carrying .gpu-check: results in $OUT (or gpu-check-results/)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    mkdir -p .gpu-check/wheels .gpu-check/tokenizer
    grep -qx '/.gpu-check/' .git/info/exclude 2>/dev/null || echo '/.gpu-check/' >> .git/info/exclude
    model="$(.venv/bin/python -c 'from daemon.model.source import resolve_model; print(resolve_model(None, progress=lambda s: None))')"
    for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
        [ -f "$model/$f" ] && cp "$model/$f" .gpu-check/tokenizer/
    done
    .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .gpu-check/wheels \
        transformers==5.24.0 "huggingface-hub>=1.0" gguf platformdirs tomli-w httptools python-json-logger
    .venv/bin/python -m pip wheel --quiet --no-deps -w .gpu-check/wheels .
    du -sh .gpu-check
    ;;
run)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-check/wheels/*.whl
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 MESHNET_CACHE_DIR=/tmp/meshnet-cache
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    python3 scripts/gpu_check.py --tokenizer .gpu-check/tokenizer --device "${DEVICE:-cuda}" \
        --out "${OUT:-gpu-check-results}" ${HIDDEN:+--hidden "$HIDDEN"}
    ;;
*)
    echo "usage: scripts/gpu_check.sh prepare | run" >&2
    exit 2
    ;;
esac
