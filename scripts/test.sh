#!/usr/bin/env bash
# The test command (README.md): the whole suite, slow tests included, on CPU.
# CUDA tests skip themselves without a GPU. pytest exits 5 when it collected no test:
# that is a broken suite here, never a pass, so it is reported as a failure.
#
#   scripts/test.sh            everything (what CI runs; about 17 minutes on 2 idle cores), in
#                              ROUNDPIPE_TEST_PROCS pytest processes (default 2,
#                              pytest-xdist; 0 runs them in this one): one process at a
#                              time left a third of two cores idle, and 3 or 4 took longer
#                              than 2 (the suite is CPU-bound: each test slowed 2-3x). Daemons
#                              start forked from a process that has imported torch and
#                              transformers (and peft, for LoRA jobs: roundpipe/forkserver.py),
#                              and a coordinator's spec checker forked from it: 22 minutes
#                              before
#   scripts/test.sh --quick    the in-process tests, for daily work (under 3 minutes, in the
#                              same pytest processes):
#                              units, the model against transformers, the trainer with
#                              in-process workers, the wire, the layering and the docs.
#                              The system tests (daemons, clusters, kills, the CLI, the
#                              benchmarks' smoke runs) and tests marked slow run in the
#                              full suite only.
#   scripts/test.sh ARGS...    pytest's own arguments (a file, -k, -x) after either
set -uo pipefail
cd "$(dirname "$0")/.."

QUICK_FILES=(
  tests/test_package_layout.py tests/test_docs.py
  tests/test_protocol.py tests/test_protocol_wire.py
  tests/test_jobspec.py tests/test_data.py tests/test_data_odd_inputs.py tests/test_instruct.py
  tests/test_planner.py tests/test_simulator.py tests/test_shape_costs.py
  tests/test_model_layers.py tests/test_model_plan.py tests/test_model_flops.py
  tests/test_model_oracle.py tests/test_model_families.py tests/test_model_executor.py
  tests/test_optimizer.py tests/test_host_memory.py tests/test_checkpoint.py
  tests/test_trainer.py tests/test_recovery.py tests/test_timeline.py
  tests/test_jobs.py tests/test_jobstore.py tests/test_keys.py tests/test_polling.py
  tests/test_events.py tests/test_handoff.py tests/test_arena.py tests/test_transfer.py
  tests/test_worker_runtime.py
)

if [ "${1:-}" = "--quick" ]; then
  shift
  # in ROUNDPIPE_TEST_PROCS processes too: one took about 7 minutes, two about 2.5
  python -m pytest -q -n "${ROUNDPIPE_TEST_PROCS:-2}" --dist worksteal -m "not slow" \
    "${QUICK_FILES[@]}" "$@"
else
  # --durations: CI's log says where the suite's time goes (its guide: ~15 minutes)
  python -m pytest -q -n "${ROUNDPIPE_TEST_PROCS:-2}" --dist worksteal --durations=25 "$@"
fi
status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; the suite is missing or broken" >&2
  exit 1
fi
exit "$status"
