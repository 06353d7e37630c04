#!/usr/bin/env bash
# Installs the Debian packages linattn needs, and only those that are missing; then the
# project's virtual environment (.venv) with its pinned PyPI packages.
# Works as root on a fresh Debian 12; uses sudo when not root.
set -euo pipefail

packages=(
  cmake make g++ pkg-config
  libhwy-dev             # Highway: SIMD with runtime dispatch, vectorised exp
  libboost-dev           # Boost.Math: chi-square quantiles and CDF for random-feature norms
  libgtest-dev           # GoogleTest, run through CTest
  libgomp1               # an OpenMP runtime for the tests of share_openmp_runtime (PyTorch brings its own)
  python3-dev python3-venv  # the Python module's headers; .venv (scripts/setup-venv.sh) holds
                         # the PyPI packages: OpenBLAS (scipy-openblas32), pybind11, numpy,
                         # PyTorch, the benchmark's peers, matplotlib, ...
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
bash "$(dirname "$0")/setup-venv.sh"
