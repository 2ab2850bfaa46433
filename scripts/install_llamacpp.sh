#!/usr/bin/env bash
# Install the llama.cpp peer (llama-cpp-python) the way this project measured it, and keep its sdist for the
# GGUF converter (fate_edge.bench.gguf unpacks convert_hf_to_gguf.py from it into ~/.cache/fate-edge-peers).
# Native CPU build with AMX off: the native build crashed in the AMX matmul on q4_0 on the development VM.
# A wheel already built in ~/.cache/fate-edge-peers/wheels is installed as is (the build takes ~20 min).
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${FATE_EDGE_PEERS_CACHE:-$HOME/.cache/fate-edge-peers}"
mkdir -p "$CACHE/wheels"
SDIST="$CACHE/wheels/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    python -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$CACHE/wheels"
fi
WHEEL=$(ls "$CACHE"/wheels/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$WHEEL" ]; then
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
        python -m pip wheel --no-deps -w "$CACHE/wheels" "$SDIST"
    WHEEL=$(ls "$CACHE"/wheels/llama_cpp_python-"$VERSION"-*.whl | head -1)
fi
python -m pip install "$WHEEL"
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
