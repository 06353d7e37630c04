#!/usr/bin/env bash
# Installs the build in $1 into a temporary prefix and builds and runs the consumer project in
# $2 against it, as a downstream user would: find_package(linattn), linattn::linattn.
set -euo pipefail
build=$1
consumer=$2
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" --component cpp > "$prefix/install.log"
cmake -S "$consumer" -B "$prefix/consumer-build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "$prefix/consumer-build" > /dev/null
"$prefix/consumer-build/consumer"
# The installed library finds its BLAS beside itself, not in this checkout.
ldd "$prefix/lib/liblinattn.so" | grep -i blas
