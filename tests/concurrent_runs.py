"""Two runs of one command into one output folder, as separate processes (`attnflow.staging.folder_lock`).

`second_run_while_first_holds` starts the first run, waits until it holds the folder's lock,
pauses it (SIGSTOP) so that it certainly still holds it, runs the second one to the end, then lets
the first continue. Used by the audit and corpus tests, which check that the second one stops
"at once": within 2 s of CPU time (no model loads); its wall time is reported, not checked, since it
grows with the machine's load (3 s at a load average of 13 on 2 cores)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import attnflow
from attnflow.staging import lock_path

CLI = [sys.executable, "-m", "attnflow.cli"]


@dataclass
class TwoRuns:
    first_pid: int
    first_code: int
    first_err: str
    second_code: int
    second_err: str
    second_seconds: float  # the second run's wall time, interpreter start-up included
    second_cpu_seconds: float  # its CPU time: what "at once" means on a loaded machine too


def second_run_while_first_holds(argv: list[str], out: Path, timeout: float = 120) -> TwoRuns:
    """Run ``attnflow ARGV`` twice into ``out``: the second while the first holds the folder."""
    source = str(Path(attnflow.__file__).resolve().parents[1])  # the attnflow these tests import
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    first = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + timeout
        while not _held_by(out, first.pid):
            assert first.poll() is None, f"the first run ended before taking the lock: {first.communicate()}"
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.02)
        first.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            second = subprocess.Popen([*CLI, *argv], stderr=subprocess.PIPE, text=True, env=env)
            assert second.stderr is not None
            second_err = second.stderr.read()  # to its end: the process has closed it
            _, status, usage = os.wait4(second.pid, 0)
            seconds = time.monotonic() - started
            second.returncode = os.waitstatus_to_exitcode(status)
        finally:
            first.send_signal(signal.SIGCONT)
        _, first_err = first.communicate(timeout=timeout)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    return TwoRuns(
        first.pid, first.returncode, first_err, second.returncode, second_err, seconds, usage.ru_utime + usage.ru_stime
    )


def _held_by(out: Path, pid: int) -> bool:
    try:
        return lock_path(out).read_text().strip() == str(pid)
    except OSError:
        return False
