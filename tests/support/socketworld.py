"""Run a scenario of tests/support/socket_scenarios.py in N real processes that
meet through ``SocketGroup`` and never import torch (the NUMA guests'
worlds: torch's import alone is ~20 s under emulation), and collect each
rank's JSON result.

One launcher interpreter (``python -m tests.support.socketworld SPEC``) imports
the scenarios once and forks the ranks from its single thread, so a world
costs one interpreter start (~3 s under emulation), not one per rank.  A
rank reports whether torch was imported."""

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .dist_harness import is_stopped

ROOT = Path(__file__).resolve().parents[2]
_MARK = "SOCKETWORLD-RESULTS "


def run_socket_world(world, scenario, *, timeout_s=120, resume_stopped=False, **kwargs):
    """``scenario`` (a function name of tests/support/socket_scenarios.py, called as
    scenario(rank, world, **kwargs)) in ``world`` processes; each rank's
    result dict (ok, error_type, message, torch_imported, exitcode).  Ranks
    left stopped (SIGSTOP) once the others are done get SIGCONT with
    ``resume_stopped`` (and are waited for), else SIGKILL."""
    spec = json.dumps([scenario, world, kwargs, timeout_s, resume_stopped])
    launcher = subprocess.run([sys.executable, "-m", "tests.support.socketworld", spec], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout_s + 60)
    lines = [line for line in launcher.stdout.splitlines() if line.startswith(_MARK)]
    assert lines, f"the launcher failed ({launcher.returncode}):\n{launcher.stderr[-3000:]}"
    return json.loads(lines[-1][len(_MARK):])


def _rank(scenario, rank, world, kwargs, fd) -> None:
    """A forked rank: run, write the result to ``fd``, leave at once."""
    from tests.support import socket_scenarios

    result = {"rank": rank}
    try:
        result.update(getattr(socket_scenarios, scenario)(rank, world, **kwargs) or {})
        result["ok"] = True
    except BaseException as exc:  # report, do not hang
        result.update(ok=False, error_type=type(exc).__name__, message=str(exc),
                      traceback=traceback.format_exc())
    result["torch_imported"] = "torch" in sys.modules
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(result, default=str))
    os._exit(0)


def _launch() -> None:
    scenario, world, kwargs, timeout_s, resume_stopped = json.loads(sys.argv[1])
    from tests.support import socket_scenarios  # noqa: F401  (imported once, before the forks)

    pids, ranks_of = [], {}  # the ranks' pids; each pipe's read end -> its rank
    for rank in range(world):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _rank(scenario, rank, world, kwargs, write_end)
        os.close(write_end)
        pids.append(pid)
        ranks_of[read_end] = rank
    outputs = [bytearray() for _ in range(world)]
    status = _collect(pids, ranks_of, outputs, timeout_s, resume_stopped)
    results = []
    for rank, (pid, data) in enumerate(zip(pids, outputs)):
        result = json.loads(data) if data else {"rank": rank, "ok": False,
                                                "error_type": "NoResult", "message": "no result"}
        result["exitcode"] = status[pid]
        results.append(result)
    print(_MARK + json.dumps(results), flush=True)


def _collect(pids, ranks_of, outputs, timeout_s, resume_stopped) -> dict:
    """Read every rank's pipe to its end (into ``outputs``) and reap every
    rank; exit codes (-signal when killed) by pid.  Only the processes this
    launcher forked are signalled."""
    deadline, resumed, status, open_fds = time.monotonic() + timeout_s, False, {}, set(ranks_of)
    while open_fds or len(status) < len(pids):  # (a rank reaped may have output unread)
        for fd in select.select(list(open_fds), [], [], 0.02)[0] if open_fds else []:
            chunk = os.read(fd, 1 << 16)
            if chunk:
                outputs[ranks_of[fd]].extend(chunk)
            else:
                open_fds.discard(fd)
                os.close(fd)
        for pid in pids:
            if pid not in status:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[pid] = os.waitstatus_to_exitcode(code)
        running = [p for p in pids if p not in status]
        late = time.monotonic() > deadline
        if running and (late or (not resumed and all(is_stopped(p) for p in running))):
            resume = resume_stopped and not late and not resumed
            for p in running:
                os.kill(p, signal.SIGCONT if resume else signal.SIGKILL)
            resumed = True  # once: after that only the deadline ends them
        if not open_fds:
            time.sleep(0.02)
    return status


if __name__ == "__main__":
    _launch()
