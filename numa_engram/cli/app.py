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
from ..literals import DEFAULT_DIRECTORY, SHARING_MODES
from .args import (
    POLICY_HELP,
    non_negative_int,
    non_negative_seconds,
    page_size_arg,
    parse_size,
    positive_int,
    register_rates,
    simulate_arg,
)
from .bench import cmd_bench
from .create import cmd_create
from .demo import cmd_demo
from .gc import cmd_gc
from .mem import cmd_mem
from .plan import cmd_plan
from .serve import cmd_serve, cmd_status
from .topo import cmd_topo
from .verify import cmd_verify


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

    sp = add("topo", cmd_topo, "NUMA nodes, cpus, memory, distances and GPUs")
    sp.add_argument("--simulate", type=simulate_arg,
                    help="'2x4' (sockets x GPUs per socket) or a topology JSON file")
    sp = add("create", cmd_create, "create, place, populate and verify a table file")
    sp.add_argument("--size", type=parse_size, default="64M",
                    help="bytes, with K, M, G or T")
    sp.add_argument("--regions", type=positive_int, default=2,
                    help="equal regions, region i read from node i mod nodes")
    sp.add_argument("--policy", default="gpu-local", help=POLICY_HELP)
    sp.add_argument("--directory", default=DEFAULT_DIRECTORY,
                    help="a tmpfs, or a hugetlbfs mount for --page-size 2M/1G (the default "
                         "then means: the mount of that page size found in /proc/self/mounts)")
    sp.add_argument("--page-size", type=page_size_arg, default="4K",
                    help="4K (shmem), 2M or 1G (hugetlb: needs a reserved pool per node)")
    sp.add_argument("--threads", type=positive_int, default=1,
                    help="threads populating huge pages")
    sp.add_argument("--hold", type=non_negative_seconds, default=0,
                    help="seconds to keep it before removing")
    sp = add("verify", cmd_verify, "report where a table's pages are (every live table, a "
             "file, or a process's)")
    sp.add_argument("path", nargs="?", help="a table file (none: every table a live process "
                    "holds, each once)")
    sp.add_argument("--pid", type=positive_int, help="every table this process holds")
    sp = add("mem", cmd_mem, "PSS/RSS per process and Shmem per node")
    sp.add_argument("pids", nargs="*", type=positive_int,
                    help="processes (none given: every process that maps a table, and those "
                    "whose command line has --match)")
    sp.add_argument("--match", default="",
                    help="also pick pids by command line (e.g. 'vllm serve')")
    sp.add_argument("--file-match", default="numa-engram-",
                    help="mappings counted per node")
    sp.add_argument("--directory", default=DEFAULT_DIRECTORY, help="the tmpfs")
    sp = add("plan", cmd_plan, "what one host of a deployment needs: bytes per node, copies, "
             "remote reads, page tables, capacity (exit 1 when it does not fit)")
    sp.add_argument("--spec", default="v4-flash",
                    help="demo, v4-flash, small, tiny, a JSON spec or a model's config.json")
    sp.add_argument("--model", default=None, help="a model directory (its config.json)")
    sp.add_argument("--page-size", type=page_size_arg, default="4K",
                    help="4K, 2M or 1G: huge-page pools per node are then planned")
    sp.add_argument("--read-gbps", type=float, default=2.0,
                    help="checkpoint read speed for the load time")
    sp.add_argument("--batch", type=positive_int, default=256,
                    help="tokens per step for the DP-sharded exchange")
    sp.add_argument("--register-s-per-gb", type=register_rates, default="4K=0.1",
                    help="cudaHostRegister seconds per GB per page size, e.g. 4K=0.1,2M=0.01 "
                    "(4K: vLLM's on an H200); a size not given is reported as not measured")
    sp.add_argument("--tp", type=positive_int, default=2, help="tensor parallel")
    sp.add_argument("--dp", type=positive_int, default=4, help="data parallel")
    sp.add_argument("--gpus-per-host", dest="gpus_per_host", type=non_negative_int, default=0,
                    help="GPUs per host (0: from the topology)")
    sp.add_argument("--mode", default="dp_shared", choices=list(SHARING_MODES),
                    help="who holds rows")
    sp.add_argument("--policy", default="gpu-local", help=POLICY_HELP)
    sp.add_argument("--simulate", type=simulate_arg, help="'2x4' or a topology JSON file")
    sp = add("bench", cmd_bench, "lookup rows/s on a placed table, per reader node")
    sp.add_argument("--size", type=parse_size, default="1G", help="table bytes")
    sp.add_argument("--policy", default="node:0", help=POLICY_HELP)
    sp.add_argument("--tokens", type=positive_int, default=100_000,
                    help="tokens per lookup")
    sp.add_argument("--threads", type=positive_int, default=2,
                    help="lookup threads")
    sp.add_argument("--repeat", type=positive_int, default=3, help="runs per node")
    sp.add_argument("--spec", default="v4-flash",
                    help="row shape from this spec: demo, v4-flash, small, tiny or a JSON file")
    sp.add_argument("--page-size", type=page_size_arg, default="4K",
                    help="4K, 2M or 1G (hugetlb: needs a reserved pool)")
    sp = add("demo", cmd_demo, "serve a model directory through EngramRuntime in DP replicas "
             "sharing placed tables, rows checked")
    sp.add_argument("--model", default=None,
                    help="a model directory (config.json, tokenizer.json, safetensors); "
                    "default: a synthetic one of --spec")
    sp.add_argument("--spec", default="small",
                    help="the synthetic model's spec: demo, small, tiny or a JSON file")
    sp.add_argument("--procs", type=positive_int, default=2,
                    help="DP replicas sharing the tables")
    sp.add_argument("--steps", type=positive_int, default=12,
                    help="serving steps per replica")
    sp.add_argument("--policy", default="gpu-local", help=POLICY_HELP)
    sp.add_argument("--directory", default=DEFAULT_DIRECTORY,
                    help="a tmpfs directory")
    sp = add("serve", cmd_serve, "hold a model's tables for this host: load once, seal, hand "
             "out descriptors to engines on a Unix socket")
    sp.add_argument("model_dir", help="the model directory (config.json, tokenizer, checkpoint)")
    sp.add_argument("--socket", required=True, help="the Unix socket engines attach through")
    sp.add_argument("--tp", type=positive_int, default=1, help="TP shards of each layer")
    sp.add_argument("--placement", default="interleave",
                    help=POLICY_HELP + "; replicate-per-node: one copy per node, each client "
                    "gets its node's")
    sp.add_argument("--page-size", type=page_size_arg, default="4K", help="4K, 2M or 1G")
    sp.add_argument("--group", default=None,
                    help="a group whose members may attach too (else only this uid and root)")
    sp.add_argument("--load-threads", type=positive_int, default=None,
                    help="threads per table load (default: one per CPU, at most 8)")
    sp = add("status", cmd_status, "what a table service holds; exit 0 when ready, 1 if not")
    sp.add_argument("--socket", required=True, help="the service's socket")
    sp = add("gc", cmd_gc, "remove table files no live process holds")
    sp.add_argument("--directory", default=DEFAULT_DIRECTORY, help="where to look")
    sp.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    sp.add_argument("--all-users", action="store_true",
                    help="root only: include other users' files (else only your own)")
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


