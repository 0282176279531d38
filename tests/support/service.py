"""Waiting for a ``numa-engram serve`` process the test started."""

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
