"""Child process for the hostile-folder matrix (tests/decoders/test_hostile_folders.py):
imports the ``writeback`` command once and runs each job given to it in-process, through
click's test runner, in the job's own directory.

``python -m tests.decoders.hostile_folder_worker JOBS RESULTS``: JOBS is a JSON list of
``[directory, [argument, ...]]``; RESULTS gets, per job, its exit status, stdout, stderr
(with the traceback of any exception other than ``SystemExit`` appended, as the real
command would print it) and the child's peak resident memory once the job has ended. The
parent caps the address space and kills the child after a timeout.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from pathlib import Path
from typing import Any


def run_jobs(jobs: list[tuple[str, list[str]]], results: Path) -> None:
    from click.testing import CliRunner
    from writeback.cli import main

    done: list[dict[str, Any]] = []
    for directory, args in jobs:
        os.chdir(directory)
        result = CliRunner().invoke(main, args, prog_name="writeback")
        stderr = result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            assert result.exc_info is not None
            stderr += "".join(traceback.format_exception(*result.exc_info))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        done.append({"status": result.exit_code, "stdout": result.stdout, "stderr": stderr, "max_resident": peak})
        # Written after every job: a job that hangs or dies leaves the earlier ones' results.
        results.write_text(json.dumps(done))


if __name__ == "__main__":
    run_jobs([(directory, list(args)) for directory, args in json.loads(sys.argv[1])], Path(sys.argv[2]))
