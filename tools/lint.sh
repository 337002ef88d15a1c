#!/usr/bin/env bash
# Lint and format checks: ruff (Python, configured in pyproject.toml) and
# clang-format (C++, .clang-format). Checks only; `tools/lint.sh --fix` applies
# the automatic fixes. Needs ruff and clang-format (pip install ruff clang-format).
set -euo pipefail
cd "$(dirname "$0")/.."

fix=0
if [[ "${1:-}" == "--fix" ]]; then fix=1; fi

# Every C and C++ source kvcached keeps in git (cpp/, tests/, bench/).
mapfile -t cxx_files < <(git ls-files -- '*.c' '*.h' '*.cpp' '*.hpp')

if (( fix )); then
  ruff check --fix .
  ruff format .
  clang-format -i "${cxx_files[@]}"
else
  ruff check .
  ruff format --check .
  clang-format --dry-run -Werror "${cxx_files[@]}"
fi
