"""numa-engram: plan, place, verify and measure Engram tables.

Every sub-command prints a table an operator can read (numactl/numastat
style) or, with --json, a document for scripts.  The placement tools do not
import torch, so they start fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from ..errors import NumaEngramError
from . import bench, create, demo, gc, mem, plan, profile, serve, topo, verify

# each command: its name, function, one-line help and its module's arguments
COMMANDS = (
    ("topo", topo.cmd_topo, topo.HELP, topo.add_arguments),
    ("create", create.cmd_create, create.HELP, create.add_arguments),
    ("verify", verify.cmd_verify, verify.HELP, verify.add_arguments),
    ("mem", mem.cmd_mem, mem.HELP, mem.add_arguments),
    ("plan", plan.cmd_plan, plan.HELP, plan.add_arguments),
    ("profile", profile.cmd_profile, profile.HELP, profile.add_arguments),
    ("bench", bench.cmd_bench, bench.HELP, bench.add_arguments),
    ("demo", demo.cmd_demo, demo.HELP, demo.add_arguments),
    ("serve", serve.cmd_serve, serve.HELP, serve.add_arguments),
    ("status", serve.cmd_status, serve.STATUS_HELP, serve.add_status_arguments),
    ("gc", gc.cmd_gc, gc.HELP, gc.add_arguments),
)


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    p = OneLineParser(prog="numa-engram", description=__doc__.splitlines()[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog=EXIT_CODES)
    p.add_argument("--version", action="version", version=f"numa-engram {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log what the library does (-vv: debug); errors then show tracebacks")
    p.add_argument("--json", action="store_true", dest="json_first",
                   help="print JSON for scripts (here or after the command)")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, func, help_text: str) -> argparse.ArgumentParser:
        # every option's help ends with its default, from the default itself
        sp = sub.add_parser(name, help=help_text, description=help_text,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        sp.add_argument("--json", action="store_true", help="print JSON for scripts")
        sp.set_defaults(func=func)
        return sp

    for name, func, help_text, add_arguments in COMMANDS:
        add_arguments(add(name, func, help_text))
    return p


class OneLineParser(argparse.ArgumentParser):
    """A wrong command line is one line on stderr and status 2 (argparse
    would print the usage too)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the command is, so every ``with`` and
    ``finally`` on the way out cleans up (as KeyboardInterrupt does for SIGINT)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


EXIT_CODES = """exit status:
  0    done (status: every table ready)
  1    the host could not do it: not enough memory or huge pages (CapacityError), a system
       call failed, a group timed out or a member failed; status: some table not ready yet
  2    what was asked is wrong: a bad value, path, pid, spec or policy (one line says which)
  141  stdout was closed early (e.g. piped into head): the output stops, quietly
  128+N stopped by signal N (what it had created is removed)"""

def _exit_code(exc: BaseException) -> int:
    from ..errors import CapacityError, CudaError, GroupTimeout, MemberFailure, SyscallError

    host = (CapacityError, CudaError, GroupTimeout, MemberFailure, SyscallError)
    return 1 if isinstance(exc, host) else 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.json = getattr(args, "json", False) or args.json_first
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    # (only the main thread may set handlers: an embedding caller's thread keeps its own)
    handled = {sig: signal.signal(sig, _raise_terminated)
               for sig in (signal.SIGTERM, signal.SIGHUP)
               if threading.current_thread() is threading.main_thread()}
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe can still be told apart
        return code
    except (KeyboardInterrupt, Terminated) as exc:
        signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
        print(f"numa-engram {args.command}: stopped by {signal.Signals(signum).name}; what it "
              "had created is removed", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        # the reader went away (| head): stop quietly, as a tool killed by SIGPIPE
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (NumaEngramError, OSError, ValueError) as exc:
        if args.verbose:
            raise
        print(f"numa-engram {args.command}: {_one_line(exc)}", file=sys.stderr)
        return _exit_code(exc)
    except Exception as exc:
        if args.verbose:
            raise
        print(f"numa-engram {args.command}: unexpected {type(exc).__name__}: {_one_line(exc)}; "
              "run with -v for the traceback", file=sys.stderr)
        return 2
    finally:
        for sig, previous in handled.items():
            signal.signal(sig, previous)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())


