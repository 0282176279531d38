"""Run a scenario in N real processes joined by torch.distributed over
gloo on 127.0.0.1, and collect each rank's JSON result.

Ranks are forked from a forkserver that imported torch and the scenarios
once per test session: a rank starts in ~0.1 s instead of the ~3 s a
fresh interpreter takes to import torch (the suite starts ~90 worlds).  A
rank takes the caller's environment, working directory and memory cgroup
as they are at ``run_world``, as a spawned one would."""

import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from datetime import timedelta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(f"{record.levelname}: {record.getMessage()}")


def enter_host(source: str, hostname: str, mount_at: str = "/dev/shm") -> None:
    """Become a process of a simulated host: own mount and UTS namespaces,
    ``source`` (that host's tmpfs) mounted at ``mount_at``, own hostname.
    Called before torch starts any thread (a mount namespace is per task)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, clone_newuts = 0x00020000, 0x04000000
    ms_rec, ms_private, ms_bind = 0x4000, 0x40000, 0x1000

    def check(rc, what):
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
    check(libc.unshare(clone_newns | clone_newuts), "unshare")
    check(libc.mount(None, b"/", None, ms_rec | ms_private, None), "mount --make-rprivate /")
    os.makedirs(mount_at, exist_ok=True)
    check(libc.mount(source.encode(), mount_at.encode(), None, ms_bind, None), "bind mount")
    check(libc.sethostname(hostname.encode(), len(hostname)), "sethostname")


# imported once, in the forkserver (before it forks any rank)
PRELOAD = ["numpy", "torch", "torch.distributed", "numa_engram", "tests.support.dist_scenarios"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (no effect once the server runs)
    return ctx


def start_forkserver() -> None:
    """Start the forkserver now, without waiting for its imports: they run
    beside the caller's (pytest's collection imports torch too; in the
    emulated NUMA guest each import takes ~20 s)."""
    from multiprocessing import forkserver

    _context()
    forkserver.ensure_running()


def _caller_state():
    """What a rank takes from its caller: environment, working directory,
    memory cgroups (a test may limit the caller's memory)."""
    from numa_engram.host.accounting import _cgroup_dirs

    return dict(os.environ), os.getcwd(), [str(d) for d, _, _ in _cgroup_dirs()]


def _become_caller(env, cwd, cgroups):
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    from numa_engram.host.accounting import _cgroup_dirs

    mine = {str(d) for d, _, _ in _cgroup_dirs()}
    for cgroup in cgroups:
        if cgroup not in mine:  # (moving needs a writable cgroup: only when it differs)
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))


def _worker(rank, world, port, scenario, kwargs, conn, pg_timeout_s, host=None, caller=None):
    if caller is not None:  # the caller's, not the forkserver's
        _become_caller(*caller)
    if host is not None:
        enter_host(*host)
    import torch.distributed as dist

    logs = _Collect()
    for name in ("numa_engram", "vllm.numa_engram"):  # the library's, the vLLM plugin's
        logging.getLogger(name).addHandler(logs)
        logging.getLogger(name).setLevel(logging.INFO)
    result = {"rank": rank}
    t0 = time.monotonic()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=pg_timeout_s))
        t0 = time.monotonic()  # the scenario's time, not the world's start-up
        result.update(scenario(rank, world, **kwargs) or {})
        result["ok"] = True
    except BaseException as exc:  # report, do not hang
        result.update(ok=False, error_type=type(exc).__name__, message=str(exc),
                      traceback=traceback.format_exc())
    result["logs"] = logs.records
    result["seconds"] = time.monotonic() - t0
    # through a pipe, not a file: a rank may have dropped to another uid
    conn.send(json.dumps(result, default=str))
    conn.close()
    os._exit(0)  # skip gloo teardown, which can block when a peer is gone


def is_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP): state T in /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def run_world(world, scenario, timeout_s=180, pg_timeout_s=60, resume_stopped=False,
              hosts=None, **kwargs):
    """Run ``scenario`` (a module-level function of tests/support/dist_scenarios.py,
    called as scenario(rank, world, **kwargs)) in ``world`` spawned ranks;
    each rank's result dict (ok, error_type, message, seconds, exitcode).
    ``resume_stopped``: once every rank that has not reported is stopped
    (SIGSTOP), they get SIGCONT and their results are collected too
    (marked ``resumed``).  ``hosts``: for each rank, (tmpfs dir, hostname,
    mount point) of the simulated host it runs on (see ``enter_host``)."""
    ctx = _context()
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    caller = _caller_state()
    procs = [ctx.Process(target=_worker, args=(r, world, port, scenario, kwargs, pipes[r][1],
                                               pg_timeout_s, hosts[r] if hosts else None, caller))
             for r in range(world)]
    for p in procs:
        p.start()
    for _, child_end in pipes:
        child_end.close()  # so a rank that dies shows up as EOF, not as silence
    deadline = time.monotonic() + timeout_s
    received, resumed, gone = {}, set(), set()
    while time.monotonic() < deadline:
        for r in range(world):
            if r not in received and r not in gone and pipes[r][0].poll():
                try:
                    received[r] = json.loads(pipes[r][0].recv())
                except EOFError:  # died without a word
                    gone.add(r)
        pending = [r for r in range(world) if r not in received and r not in gone]
        if not pending:
            break
        if not resumed and all(is_stopped(procs[r].pid) for r in pending):
            if not resume_stopped:
                break  # nothing more will come: killed below
            for r in pending:
                os.kill(procs[r].pid, signal.SIGCONT)
            resumed = set(pending)
        time.sleep(0.05)
    for r, p in enumerate(procs):
        if r in received or r in gone:  # it has said its word: let it exit
            p.join(max(0.1, deadline - time.monotonic()))
    results = []
    for r, p in enumerate(procs):
        if p.is_alive():  # only processes this harness started, by pid
            os.kill(p.pid, signal.SIGKILL)
            p.join()
        res = received.get(r, {"rank": r, "ok": False, "error_type": "NoResult",
                                "message": "no result"})
        res["exitcode"] = p.exitcode
        res["resumed"] = r in resumed
        results.append(res)
    return results


def same_failure(results, error_type, text=None, ranks=None):
    """Every rank (of ``ranks``, default all) failed with ``error_type``,
    its message containing ``text``."""
    for r in results:
        if ranks is not None and r["rank"] not in ranks:
            continue
        assert not r["ok"] and r["error_type"] == error_type, r
        if text is not None:
            assert text in r["message"], r["message"]
