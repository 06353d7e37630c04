#!/usr/bin/env bash
# Creates the project's virtual environment in .venv (from Debian's python3) and installs the
# pinned PyPI packages of requirements/*.txt, under requirements/constraints.txt (every
# transitive package pinned). Does nothing when .venv already matches those files.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
stamp=$venv/.linattn-requirements
want=$(cat requirements/*.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
[ -x $venv/bin/python ] || /usr/bin/python3 -m venv $venv
$venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip==26.3
args=()
for f in requirements/*.txt; do
  [ "$(basename "$f")" = constraints.txt ] || args+=(-r "$f")
done
$venv/bin/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt "${args[@]}"
echo "$want" > "$stamp"
