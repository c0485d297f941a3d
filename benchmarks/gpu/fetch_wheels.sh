#!/usr/bin/env bash
# Run here (a machine with pip's registries), once per session, before the first device call:
# downloads into .whl/ (git-ignored through .git/info/exclude) what the lent GPU machine lacks
# for run_all.sh: ortools and its two pins that image does not meet (immutabledict,
# protobuf 6.33), for CPython 3.12 on x86-64. About 30 MiB, inside
# the device tool's 64 MiB per call. Then call the device tool with carry [".whl"] and
#   source benchmarks/gpu/device_setup.sh && PYTHON=python3 bash benchmarks/gpu/run_all.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl "ortools==$("$PY" -c 'import ortools; print(ortools.__version__)')" \
  immutabledict "protobuf>=6.33.1,<6.34"
ls -la .whl
