#!/usr/bin/env bash
# Lint and format checks: ruff (Python, configured in pyproject.toml) and
# clang-format (C++, .clang-format). `tools/lint.sh` checks and fails if any
# check fails; `tools/lint.sh --fix` applies the automatic fixes, then reports
# what is left to fix by hand. Needs ruff and clang-format (pip install ruff clang-format).
set -uo pipefail
cd "$(dirname "$0")/.."

# Every C and C++ source kvcached keeps in git (cpp/, tests/, bench/).
mapfile -t cxx_files < <(git ls-files -- '*.c' '*.h' '*.cpp' '*.hpp')

if [[ "${1:-}" == "--fix" ]]; then
  ruff check --fix --quiet . >/dev/null
  ruff format --quiet .
  clang-format -i "${cxx_files[@]}"
fi

failed=0
ruff check . || failed=1
ruff format --check . || failed=1
clang-format --dry-run -Werror "${cxx_files[@]}" || failed=1
exit "$failed"
