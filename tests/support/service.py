"""A table service for a test: waiting for a ``numa-engram serve`` process
the test started, or one started in the test's own process."""

import os
import time

from numa_engram.store import serviceclient


def wait_ready(path, proc, timeout_s=120):
    """The service's status once every table is ready; an AssertionError
    naming its stderr if it exits first, or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the service exited: {proc.stderr.read()[-3000:]}")
        if os.path.exists(path):
            try:
                doc = serviceclient.status(path)
                if doc["ready"]:
                    return doc
            except Exception:  # listening but not answering yet
                pass
        time.sleep(0.05)
    raise AssertionError(f"the table service was not ready in {timeout_s} s")


def start_service(model_dir, socket_path, tp=1):
    """A table service in this process over ``model_dir`` (of the family its
    config says), listening at ``socket_path``, every table loaded; the
    caller stops it."""
    from numa_engram.runtime.modeldirs import open_model_directory
    from numa_engram.service.tableservice import TableService

    held = TableService(open_model_directory(str(model_dir)), str(socket_path), tp=tp)
    held.start()
    held.load_all()
    return held
