#!/usr/bin/env bash
# Installs the Debian packages linattn needs, and only those that are missing.
# Works as root on a fresh Debian 12; uses sudo when not root.
set -euo pipefail

packages=(
  cmake make g++ pkg-config
  libopenblas-dev        # BLAS: sgemm/dgemm for every matrix product
  libhwy-dev             # Highway: SIMD with runtime dispatch, vectorised exp
  libboost-dev           # Boost.Math: chi-square quantiles and CDF for random-feature norms
  libgtest-dev           # GoogleTest, run through CTest
  pybind11-dev python3-dev python3-numpy python3-pytest
  python3-scipy          # tests only: independent chi-square quantiles and KS tests
)
if [ "${LINATTN_WITH_BENCH_DEPS:-0}" = 1 ]; then
  packages+=(python3-torch python3-matplotlib)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
