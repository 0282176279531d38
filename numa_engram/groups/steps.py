"""The collective steps of the create protocol: a step every member works
in (``every``), a step only the leader works in (``lead``), and the rule
that makes every member end a failed step the same way: each member's
error travels as an ``Outcome`` and every member raises the same class
(ours as itself, with its fields; anything else as MemberFailure) naming
every failing member.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .. import errors
from ..errors import NumaEngramError
from .group import Group

T = TypeVar("T")
log = logging.getLogger(__name__)

# Test hook: called with "before-<step>" and "after-<step>" of each protocol
# step (join, decide, create, map, unlink, load, ready; and "load-progress")
# e.g. to kill the leader between create and unlink.  None in production.
STEP_HOOK: Callable[[str], None] | None = None


def step_hook(name: str) -> None:
    if STEP_HOOK is not None:
        STEP_HOOK(name)


@dataclass(frozen=True)
class Outcome:
    """What one member reports after a step: ok (with a value), or its
    error as (type name, message, structured fields)."""

    ok: bool
    error_type: str = ""
    message: str = ""
    value: Any = None
    fields: dict = field(default_factory=dict)


def attempt(fn: Callable[[], Any]) -> tuple[Any, Outcome]:
    """Run one member's part of a step; every Exception becomes an Outcome
    the others see (KeyboardInterrupt and SystemExit still propagate)."""
    try:
        return fn(), Outcome(True)
    except Exception as exc:
        log.debug("member step failed", exc_info=True)
        fields = exc.fields() if isinstance(exc, NumaEngramError) else {}
        return None, Outcome(False, type(exc).__name__, str(exc), fields=fields)


def error_class(type_name: str) -> type[NumaEngramError] | None:
    cls = getattr(errors, type_name, None)
    return cls if isinstance(cls, type) and issubclass(cls, NumaEngramError) else None


def explaining_failure(outcomes: list[Outcome]) -> Outcome:
    """The failure that explains the others: the first that is not a
    loader's echo of another member's failed load."""
    failed = [o for o in outcomes if not o.ok]
    return next((o for o in failed if o.error_type != errors.PeerLoadFailed.__name__), failed[0])


def raise_failures(outcomes: list[Outcome], ranks: tuple[int, ...], step: str) -> None:
    """The same exception in every member: the failing member's class (ours
    as itself, with its fields; anything else as MemberFailure); the
    message names every failing member."""
    failures = [(member, ranks[member] if member < len(ranks) else member, step,
                 o.error_type, o.message) for member, o in enumerate(outcomes) if not o.ok]
    if not failures:
        return
    cause = explaining_failure(outcomes)
    cls = error_class(cause.error_type) or errors.MemberFailure
    if len(failures) == 1:
        member, rank, _, type_name, message = failures[0]
        text = (f"sharing group failed at step '{step}' on member {member} (rank {rank}): "
                f"{message}")
    else:
        text = f"sharing group failed at step '{step}' on {len(failures)} members: " + "; ".join(
            f"member {m} (rank {r}) {t}: {msg}" for m, r, _, t, msg in failures)
    exc = cls.rebuild(text, cause.fields)
    exc.failures = failures
    raise exc


def lead(grp: Group, step: str, fn: Callable[[], Any]) -> Any:
    """A step only the leader works in: its outcome (and value) broadcast;
    every member raises alike when it failed."""
    step_hook(f"before-{step}")
    outcome = None
    if grp.rank == 0:
        value, outcome = attempt(fn)
        outcome = Outcome(True, value=value) if outcome.ok else outcome
    outcome = grp.broadcast(outcome, step)
    step_hook(f"after-{step}")
    raise_failures([outcome], grp.ranks[:1], step)
    return outcome.value


def every(grp: Group, step: str, fn: Callable[[], Any]) -> tuple[Any, list[Outcome]]:
    """A step every member works in: its value, and every member's outcome
    (the caller raises alike from them with ``raise_failures``)."""
    step_hook(f"before-{step}")
    value, outcome = attempt(fn)
    outcomes = grp.all_gather(Outcome(True, value=value) if outcome.ok else outcome, step)
    step_hook(f"after-{step}")
    return value, outcomes


def unless_failed(outcome: Outcome, value: T) -> T:
    """value, or the failure ``outcome`` holds raised again."""
    raise_unless(outcome)
    return value


def raise_unless(outcome: Outcome) -> None:
    if not outcome.ok:
        raise (error_class(outcome.error_type) or errors.MemberFailure).rebuild(
            outcome.message, outcome.fields)
