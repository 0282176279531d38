"""A sharing group whose members are threads of this process: the create
protocol runs unchanged over any object with the Group surface, so the
protocol x fault-point matrix runs in milliseconds per member instead of a
torch world per case.  A member's values are pickled through the meeting
place, as they travel between processes; a collective that times out
breaks the group, as a gloo group is broken after one (every later
collective of every member raises GroupTimeout at once)."""

import pickle
import threading
import time
import traceback

from numa_engram.errors import GroupTimeout
from numa_engram.groups import steps
from numa_engram.groups.group import Members


class ThreadWorld:
    """The meeting place of ``size`` thread members."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._calls: dict[int, dict[int, bytes]] = {}
        self.broken = ""  # the step that timed out, once one has

    def group(self, rank: int, timeout_s: float) -> "ThreadGroup":
        return ThreadGroup(self, rank, timeout_s)

    def meet(self, rank: int, call: int, step: str, data: bytes, timeout_s: float) -> list[bytes]:
        """Every member's bytes for collective number ``call``."""
        with self._cond:
            if self.broken:
                raise GroupTimeout(f"step '{step}': the sharing group is broken (step "
                                   f"'{self.broken}' timed out); make a new one")
            arrived = self._calls.setdefault(call, {})
            arrived[rank] = data
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: len(arrived) == self.size or self.broken,
                                       timeout_s)
            if len(arrived) == self.size:
                return [arrived[r] for r in range(self.size)]
            if not done:
                self.broken = step
                self._cond.notify_all()
                missing = sorted(set(range(self.size)) - set(arrived))
                raise GroupTimeout(f"step '{step}': the sharing group {list(range(self.size))} "
                                   f"did not complete within {timeout_s:.0f} s or a member "
                                   f"died; member(s) at world rank(s) {missing} did not arrive")
            raise GroupTimeout(f"step '{step}': the sharing group is broken (step "
                               f"'{self.broken}' timed out in another member)")


class ThreadGroup(Members):
    """One thread member's view of a ThreadWorld (the Group protocol)."""

    process_group = None

    def __init__(self, world: ThreadWorld, rank: int, timeout_s: float) -> None:
        super().__init__(rank, world.size, tuple(range(world.size)), timeout_s,
                         "threads of one process")
        self._world, self._calls = world, 0

    def _meet(self, step: str, obj) -> list:
        call, self._calls = self._calls, self._calls + 1
        data = self._world.meet(self._rank, call, step, pickle.dumps(obj), self.timeout_s)
        return [pickle.loads(d) for d in data]

    def broadcast(self, obj, step: str):
        return self._meet(step, obj if self._rank == 0 else None)[0]

    def all_gather(self, obj, step: str) -> list:
        return self._meet(step, obj)

    def barrier(self, step: str) -> None:
        self._meet(step, None)


class Vanished(BaseException):
    """Ends a thread member that the fault 'killed' (not an Exception: the
    protocol's per-step error capture must not report it)."""


class Fault:
    """The step hook of a thread world: member ``victim`` stops at
    ``point`` ("stop": until ``resume()``; "kill": for good, then unwinds
    with Vanished once released)."""

    def __init__(self, victim: int, point: str, action: str) -> None:
        self.victim, self.point, self.action = victim, point, action
        self.here = threading.local()
        self.reached = threading.Event()
        self._go = threading.Event()

    def hook(self, step: str) -> None:
        if getattr(self.here, "rank", None) != self.victim or step != self.point \
                or self.reached.is_set():
            return  # once: a resumed member goes on
        self.reached.set()
        self._go.wait()
        if self.action == "kill":
            raise Vanished(step)

    def resume(self) -> None:
        self._go.set()


def run_threads(size: int, member, *, fault: Fault | None = None, timeout_s: float = 60):
    """member(rank, world) in ``size`` threads; each one's result dict (ok,
    error_type, message, seconds, plus what member returned).  With a
    ``fault``, the victim is released once every other member has ended."""
    world, results = ThreadWorld(size), [dict(rank=r) for r in range(size)]

    def run(rank: int) -> None:
        if fault is not None:
            fault.here.rank = rank
        t0 = time.monotonic()
        try:
            results[rank].update(member(rank, world) or {}, ok=True)
        except Vanished:
            results[rank].update(ok=False, error_type="Vanished", message="")
        except Exception as exc:
            results[rank].update(ok=False, error_type=type(exc).__name__, message=str(exc),
                                 traceback=traceback.format_exc())
        results[rank]["seconds"] = time.monotonic() - t0

    saved, steps.STEP_HOOK = steps.STEP_HOOK, fault.hook if fault else None
    try:
        threads = [threading.Thread(target=run, args=(r,), name=f"member-{r}") for r in range(size)]
        for t in threads:
            t.start()
        others = [t for r, t in enumerate(threads) if fault is None or r != fault.victim]
        for t in others:
            t.join(timeout_s)
        if fault is not None:
            fault.resume()
        for t in threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in threads), "a member did not end"
    finally:
        steps.STEP_HOOK = saved
    return results
