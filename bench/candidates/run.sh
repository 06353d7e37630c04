#!/usr/bin/env bash
# Builds and runs bench/candidates/tile_products.cc: the float32 attention-tile products on
# linattn's own kernels, OpenBLAS, BLIS, libxsmm and oneDNN, one thread. Needs the project built
# (make build-cpp) and, for this comparison only, Debian's libblis-dev libxsmm-dev libdnnl-dev
# (apt-get install -y libblis-dev libxsmm-dev libdnnl-dev). Run it as users run: with
# OPENBLAS_CORETYPE unset, and again with OPENBLAS_CORETYPE=Haswell for the forced core.
set -euo pipefail
cd "$(dirname "$0")/../.."
openblas=$(ls .venv/lib/python3.11/site-packages/scipy_openblas32/lib/libscipy_openblas*.so | head -1)
out=build/tile_products
g++ -O2 -std=c++20 -Isrc -Iinclude -I/usr/include/x86_64-linux-gnu/blis-openmp bench/candidates/tile_products.cc \
  src/linattn/core/{tile_matmul,simd,error,low_precision,memory,parallel}.cc \
  -L/usr/lib/x86_64-linux-gnu/blis-openmp -l:libblis.so.4 /usr/lib/libxsmm.a /usr/lib/libxsmmnoblas.a -ldnnl \
  "$openblas" -Wl,-rpath,"$(dirname "$openblas")" -lhwy -lhwy_contrib -lgomp -lpthread -ldl -o "$out"
OMP_NUM_THREADS=1 BLIS_NUM_THREADS=1 taskset -c "${CPU:-0}" "$out"
