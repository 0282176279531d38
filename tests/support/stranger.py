"""A client of another uid: a forked child that drops to uid and gid 65534
(nobody) and asks a socket, to show what a stranger gets."""

import os

from numa_engram.store import serviceclient

NOBODY = 65534


def ask_as_nobody(sock: str, request: dict) -> str:
    """Send ``request`` to ``sock`` as uid 65534 in a forked child (plain
    sockets, no torch): "<the answer's reason, or answered> fds=<how many
    descriptors came>", or "error <what it met>"."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            answer, fds, _ = serviceclient.ask(sock, request)
            os.write(write, f"{answer.get('reason', 'answered')} fds={len(fds)}".encode())
        except BaseException as exc:
            os.write(write, f"error {exc}".encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as fh:
        return fh.read()
