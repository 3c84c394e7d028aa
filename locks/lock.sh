#!/usr/bin/env bash
# Resolve this project's own environments into the committed lock files, on purpose.
#
#   bash locks/lock.sh            # refresh every lock (after changing pyproject.toml or locks/pins.in)
#
# The locks are pip constraints files: `pip install -c locks/test.txt -e '.[test]'` installs exactly
# the versions here with plain pip (no resolver backtracking: one candidate per package), so a new
# user needs nothing but Python and pip. Nothing refreshes them by accident: CI and the README only
# read them. Resolving takes uv, pinned here so that two refreshes of the same inputs agree.
#
#   test.txt    extras test + dev (the suite and the contracts .ci/run checks)
#   bench.txt   extras bench + demo + test (bench/ beside the peers)
#   demo.txt    extra demo (the README's first command)
#   lowest.txt  the core dependencies at the lowest versions pyproject.toml allows
#               (uv's --resolution lowest-direct): .ci/run proves those bounds by running the
#               torch-free tests on them (locks/lowest-tests.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
PY=3.11
PLATFORM=x86_64-manylinux_2_28

tooldir=$(mktemp -d)
trap 'rm -rf "$tooldir"' EXIT
python3 -m venv "$tooldir/venv"
"$tooldir/venv/bin/python" -m pip install -q "uv==$UV_VERSION"
uv=("$tooldir/venv/bin/uv" pip compile --python-version "$PY" --python-platform "$PLATFORM"
    --no-header --annotation-style line --color never)

header() {  # what made the file and how to use it
  printf '# %s\n# made by locks/lock.sh (uv %s, Python %s, %s); edit pyproject.toml or locks/pins.in, then rerun it\n' \
    "$1" "$UV_VERSION" "$PY" "$PLATFORM"
}

compile() {  # out description uv-args...
  local out=$1 what=$2; shift 2
  { header "$what"; "${uv[@]}" "$@" 2>/dev/null; } > "locks/$out.tmp"
  mv "locks/$out.tmp" "locks/$out"
  echo "locks/$out: $(grep -c '==' "locks/$out") pins"
}

compile test.txt "pip install -c locks/test.txt -e '.[test,dev]'" \
  pyproject.toml --extra test --extra dev -c locks/pins.in
compile bench.txt "pip install -c locks/bench.txt -e '.[bench,demo,test]'" \
  pyproject.toml --extra bench --extra demo --extra test -c locks/pins.in
compile demo.txt "pip install -c locks/demo.txt -e '.[demo]'" \
  pyproject.toml --extra demo -c locks/pins.in
compile lowest.txt "pip install -c locks/lowest.txt -e . (the lowest versions pyproject.toml allows)" \
  pyproject.toml --resolution lowest-direct
