#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources the llama-cpp-python sdist vendors (PyPI only: no
# git, no model hub), for scripts/bench_compare.py --llama-server. Prints the binary's path.
#
#   scripts/build_llama_server.sh [DEST]     # default ~/.cache/rill/llama.cpp; ~12 min on 2 cores
#
# LLAMA_CMAKE_ARGS adds cmake options, e.g. the AVX2 build that stands beside Rill's kernels built
# with RILL_NATIVE_MARCH=haswell on a newer CPU (give it its own DEST):
#   LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" \
#     scripts/build_llama_server.sh ~/.cache/rill/llama.cpp-avx2
set -euo pipefail
dest=${1:-$HOME/.cache/rill/llama.cpp}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
bin="$dest/build/bin/llama-server"
if [ ! -x "$bin" ]; then
  here=$(cd "$(dirname "$0")/.." && pwd)
  python=${PYTHON:-$here/.venv/bin/python}
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "build_llama_server: fetching llama-cpp-python $version (sdist) ..." >&2
  "$python" -m pip download "llama-cpp-python==$version" --no-deps --no-binary :all: -d "$tmp" -q
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  mkdir -p "$dest/src"
  cp -a "$tmp"/llama_cpp_python-*/vendor/llama.cpp/. "$dest/src/"
  echo "build_llama_server: building llama-server (Release, this CPU's instructions) ..." >&2
  cmake -S "$dest/src" -B "$dest/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF ${LLAMA_CMAKE_ARGS:-} >&2
  cmake --build "$dest/build" --target llama-server -j "$(nproc)" >&2
fi
echo "$bin"
