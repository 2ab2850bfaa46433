#!/usr/bin/env bash
# Install the llama.cpp peer (llama-cpp-python) the way this project measures it, and keep its sdist for the
# GGUF converter (fate_edge_lab.bench.gguf unpacks convert_hf_to_gguf.py from it into ~/.cache/fate-edge-peers).
# CPU build with every instruction set this host has except AMX: on these VMs the CPU reports AMX but the tile
# instructions fault (SIGILL; earlier, a crash in the AMX matmul on q4_0), and GGML_NATIVE=ON turns AMX on through
# -march=native whatever GGML_AMX_* say. So GGML_NATIVE=OFF and the ISA flags are named one by one.
# A wheel already built for the same flags in ~/.cache/fate-edge-peers/wheels/<flags hash> is installed as is
# (the build takes ~20 min on 2 cores).
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${FATE_EDGE_PEERS_CACHE:-$HOME/.cache/fate-edge-peers}"
mkdir -p "$CACHE/wheels"
SDIST="$CACHE/wheels/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    # --no-binary for this package only: with :all: pip also built the sdist's build requirements (scikit-build-core
    # and its own) from source just to read its metadata, minutes on 2 cores before the download finished
    python -m pip download --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION" -d "$CACHE/wheels"
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)"
CMAKE_ARGS+=" -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX_VNNI=$(has avx_vnni)"
CMAKE_ARGS+=" -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)"
CMAKE_ARGS+=" -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
CMAKE_ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
WHEELS="$CACHE/wheels/$(echo "$VERSION $CMAKE_ARGS" | sha256sum | cut -c1-12)"
mkdir -p "$WHEELS"
WHEEL=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$WHEEL" ]; then
    echo "building llama-cpp-python $VERSION with $CMAKE_ARGS"
    CMAKE_ARGS="$CMAKE_ARGS" python -m pip wheel --no-deps -w "$WHEELS" "$SDIST"
    WHEEL=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl | head -1)
fi
python -m pip install --force-reinstall --no-deps "$WHEEL"
# --no-deps above keeps this venv's numpy as it is; the wheel's other requirements still have to be there (diskcache
# is not otherwise installed, and without it `import llama_cpp` fails).
python -m pip install "typing-extensions>=4.5.0" "numpy>=1.20.0" "diskcache>=5.6.1" "jinja2>=2.11.3"
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed:',
           llama_cpp.llama_print_system_info().decode())"
