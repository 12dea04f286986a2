#!/usr/bin/env bash
# The test command (README.md): the whole suite, slow tests included, on CPU.
# CUDA tests skip themselves without a GPU. pytest exits 5 when it collected no test:
# that is a broken suite here, never a pass, so it is reported as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; the suite is missing or broken" >&2
  exit 1
fi
exit "$status"
