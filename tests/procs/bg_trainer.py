"""Child for tests/test_background_checkpoint.py: train a job (JSON spec) as job
"job-kill" with in-process workers, resuming from its newest checkpoint, until killed.

    bg_trainer.py SPEC_JSON ARENA_DIR NAMESPACE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime_helpers import trained_in_process  # noqa: E402

from roundpipe.coordinator.spec.jobspec import JobSpec  # noqa: E402


def main() -> None:
    spec = JobSpec.from_dict(json.loads(Path(sys.argv[1]).read_text()))
    with trained_in_process(spec, Path(sys.argv[2]), 2, job_id="job-kill", namespace=sys.argv[3]):
        pass


if __name__ == "__main__":
    main()
