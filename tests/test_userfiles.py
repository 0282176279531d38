"""numa_engram/userfiles.py: a file a user names is opened without
blocking, refused by name unless regular, read under a bound; a name
printed is escaped.  Each hostile case runs in a thread joined with a
timeout, so a regression fails instead of hanging the run."""

import os
import socket
import threading

import pytest

from numa_engram.errors import CheckpointError, NumaEngramError
from numa_engram.userfiles import open_regular, printable, read_regular


def _within(seconds, call, *args, **kwargs):
    """``call``'s result or exception, or a failure when it is still
    running after ``seconds`` (blocked on a FIFO, reading a device)."""
    out = []

    def run():
        try:
            out.append(call(*args, **kwargs))
        except BaseException as exc:
            out.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call.__name__}{args} still running after {seconds} s"
    return out[0]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "config.json"
    os.mkfifo(path)
    yield path
    try:  # a reader blocked in open (a regression) gets a writer, then EOF
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_fifo_is_refused_by_name_without_blocking(fifo):
    got = _within(10, read_regular, fifo, "the model's config", error=CheckpointError)
    assert isinstance(got, CheckpointError), got
    assert str(got) == (f"the model's config {fifo} is a FIFO, not a regular file; pass the "
                        f"file itself")


@pytest.mark.parametrize("path, kind", [("/dev/zero", "a character device"),
                                        ("/dev/null", "a character device"),
                                        ("{tmp}", "a directory"),
                                        ("{sock}", "a socket")])
def test_devices_directories_and_sockets_are_refused_by_kind(tmp_path, path, kind):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    path = path.format(tmp=tmp_path, sock=tmp_path / "s")
    try:
        got = _within(10, read_regular, path, "the spec file")
    finally:
        listener.close()
    assert type(got) is NumaEngramError and f"the spec file {path} is {kind}" in str(got), got


def test_a_symlink_to_a_device_is_refused_and_nofollow_refuses_any_symlink(tmp_path):
    link = tmp_path / "config.json"
    link.symlink_to("/dev/zero")
    got = _within(10, read_regular, link, "the model's config")
    assert "is a character device, not a regular file" in str(got), got
    (tmp_path / "real").write_text("{}")
    link.unlink()
    link.symlink_to(tmp_path / "real")
    assert read_regular(link, "the model's config") == b"{}"
    with pytest.raises(NumaEngramError, match="is a symlink, not a regular file"):
        open_regular(link, "the model's config", follow_symlinks=False)


def test_a_file_above_the_bound_is_refused_naming_both_sizes(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b" " * 1001)
    with pytest.raises(NumaEngramError, match=r"is 1001 bytes, above the 1000 such a file may"):
        read_regular(path, "the spec file", limit=1000)
    assert read_regular(path, "the spec file", limit=1001) == b" " * 1001


def test_a_missing_or_unreadable_file_is_the_callers_error_naming_it(tmp_path):
    with pytest.raises(CheckpointError, match=r"the checkpoint index .*nope: cannot open it "
                                              r"\(No such file or directory\)"):
        read_regular(tmp_path / "nope", "the checkpoint index", error=CheckpointError)


def test_an_open_descriptor_is_a_regular_files_and_not_blocking(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    fd = open_regular(path, "checkpoint")
    try:
        assert os.read(fd, 10) == b"abc"
        assert os.get_blocking(fd) is False  # (no effect on a regular file)
    finally:
        os.close(fd)


@pytest.mark.parametrize("name, shown", [
    ("plain name.json", "plain name.json"),
    ("a\nremoved  forged", "a\\nremoved  forged"),
    ("tab\there", "tab\\there"),
    ("back\\slash\r", "back\\\\slash\\r"),
    ("bad-\udcff-bytes", "bad-\\udcff-bytes"),
    ("émoji ✓", "émoji ✓"),
])
def test_printable_escapes_what_would_forge_output(name, shown):
    assert printable(name) == shown
    assert "\n" not in printable(name) and "\r" not in printable(name)


READ_IN_A_CHILD = """
import sys
import numpy as np
from numa_engram.cli.args import load_topology
from numa_engram.errors import NumaEngramError
from numa_engram.model.ple import PLESpec
from numa_engram.model.spec import EngramSpec
from numa_engram.runtime.modeldir import read_config_file
from numa_engram.checkpoints.safetensorsfiles import read_header, read_index

READERS = {
    "EngramSpec.named": EngramSpec.named,
    "EngramSpec.from_config": lambda p: EngramSpec.from_config(p, (np.arange(9), 9)),
    "PLESpec.from_config": PLESpec.from_config,
    "plan --simulate": load_topology,
    "config.json": read_config_file,
    "checkpoint index": read_index,
    "safetensors header": read_header,
}
try:
    READERS[sys.argv[1]](sys.argv[2])
    print("read it")
except NumaEngramError as exc:
    print(type(exc).__name__, exc)
"""
READERS = ["EngramSpec.named", "EngramSpec.from_config", "PLESpec.from_config",
           "plan --simulate", "config.json", "checkpoint index", "safetensors header"]


@pytest.mark.slow
@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_every_reader_of_a_named_file_refuses_a_fifo_or_device_at_once(tmp_path, reader, kind):
    """In a child under a time and a memory bound: a regression that blocks
    on the FIFO or reads /dev/zero without end fails, never hangs the run
    or eats the host."""
    import subprocess
    import sys

    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    path = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    try:
        child = subprocess.run([sys.executable, "-c", READ_IN_A_CHILD, reader, str(path)],
                               capture_output=True, text=True, timeout=60, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{reader} blocked on {kind}")
    assert child.returncode == 0, child.stderr[-2000:]
    what = "a FIFO" if kind == "fifo" else "a character device"
    assert f"{path} is {what}, not a regular file" in child.stdout, (reader, child.stdout)
