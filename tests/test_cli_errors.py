"""Every wrong command line: one line on stderr naming the wrong value and
what to do, exit status 2, never a traceback.  Through ``main(argv)`` in
this process (``python -m numa_engram`` exits with what it returns); the
real command, for what only a process shows: its exit status as the shell
sees it, signals, a closed pipe, stray output at start-up."""

import os
import subprocess
import sys

import pytest

from .conftest import cli_in_process

slow = pytest.mark.slow  # starts the real command


def real_command(*args):
    """The real ``python -m numa_engram ARGS``."""
    return subprocess.run([sys.executable, "-m", "numa_engram", *args], capture_output=True,
                          text=True, timeout=120)


def cli(*args):
    return cli_in_process(*args, check=False)


def _a_file_that_is_not_a_table(tmp_path):
    path = tmp_path / "not-a-table"
    path.write_bytes(b"hello" * 1000)
    return str(path)


def _a_dead_pid():
    child = subprocess.Popen(["true"])
    child.wait()
    return str(child.pid)


CASES = [
    (["create", "--size", "1X"], "'1X'"),
    (["create", "--size=-5M"], "'-5M'"),
    (["create", "--size", "0"], "'0'"),
    (["create", "--size", "1M", "--policy", "node:7"], "node 7"),
    (["create", "--size", "1M", "--policy", "node:-1"], "node:-1"),
    (["create", "--size", "1M", "--policy", "sideways"], "'sideways'"),
    (["plan", "--simulate", "9x9x9"], "'9x9x9'"),
    (["plan", "--simulate", "2x-3"], "'2x-3'"),
    (["plan", "--tp", "0"], "--tp"),
    (["plan", "--dp", "-1"], "--dp"),
    (["demo", "--procs", "0"], "--procs"),
    (["create", "--size", "1M", "--directory", "/no/such/dir"], "/no/such/dir"),
    (["gc", "--directory", "/no/such/dir"], "/no/such/dir"),
    (["create", "--size", "1M", "--directory", "{tmp}"], "not on tmpfs"),
    (["verify", "/no/such/table"], "/no/such/table"),
    (["verify", "{not_a_table}"], "not a numa_engram backing file"),
    (["verify", "--pid", "{dead_pid}"], "no process"),
    (["verify", "{fifo}"], "not a regular file"),  # opened without blocking, then refused
    (["mem", "--directory", "/no/such/dir"], "/no/such/dir"),
    (["mem", "{dead_pid}"], "no process"),
    (["create", "--size", "1M", "--page-size", "3M"], "'3M'"),
    (["create", "--size", "1M", "--page-size", "2M", "--directory", "{tmp}"],
     "not a hugetlbfs mount of 2M pages"),
    (["bench", "--size", "1M", "--spec", "nosuch"], "nosuch"),
    (["bench", "--size", "100", "--spec", "v4-flash"], "holds no row"),
]


@pytest.mark.parametrize("argv, names", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_wrong_input_is_one_clear_line_and_status_2(tmp_path, argv, names):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    values = {"tmp": str(tmp_path), "not_a_table": _a_file_that_is_not_a_table(tmp_path),
              "dead_pid": _a_dead_pid(), "fifo": str(fifo)}
    argv = [a.format(**values) for a in argv]
    names = names.format(**values)
    out = cli(*argv)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert names in lines[0], lines[0]


@slow
def test_the_real_command_says_one_line_and_exits_2():
    """As the shell sees it: status 2 and one line, nothing else on stderr."""
    out = real_command("create", "--size", "1X")
    assert out.returncode == 2 and out.stdout == "", (out.returncode, out.stdout)
    assert out.stderr.splitlines() == [cli("create", "--size", "1X").stderr.strip()], \
        out.stderr  # the line main(argv) writes, and only it
    assert out.stderr.startswith("numa-engram create: argument --size: size '1X' is not a size")


def test_version_and_verbose():
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("numa-engram ")
    assert cli("-v", "topo").returncode == 0


def test_every_option_of_every_command_documents_its_default():
    from numa_engram.cli.app import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        text = sub.format_help()
        for action in sub._actions:
            if not action.option_strings or action.dest in ("help", "json"):
                continue
            assert action.help, f"{name} {action.option_strings} has no help"
            if action.default is not None and not isinstance(action.default, bool):
                assert f"(default: {action.default})" in " ".join(text.split()), \
                    f"{name} {action.option_strings[0]}: no default shown"
            if action.choices:
                assert "{" + ",".join(action.choices) + "}" in text


@slow
def test_a_stale_core_is_a_clear_import_error():
    # the package claims another version than the one the core was built for
    child = subprocess.run([sys.executable, "-c",
                            "import sys, types\n"
                            "fake = types.ModuleType('numa_engram._version')\n"
                            "fake.__version__ = '0.0.0'\n"
                            "sys.modules['numa_engram._version'] = fake\n"
                            "import numa_engram.bindings.native"], capture_output=True, text=True)
    assert child.returncode != 0
    assert "built for version" in child.stderr and "stale build" in child.stderr
    assert "reinstall" in child.stderr


# ------------------------------------------------------- signals, sizes --

def test_implausible_sizes_and_bad_values_are_refused_at_once(tmp_path):
    import time

    from .conftest import shm_files

    t0 = time.monotonic()
    r = cli("plan", "--dp", "1000000")
    assert r.returncode == 2 and time.monotonic() - t0 < 30
    assert len(r.stderr.splitlines()) == 1 and "2000000 GPUs" in r.stderr, r.stderr
    before = shm_files()
    r = cli("create", "--size", "1M", "--hold", "-1")
    assert r.returncode == 2 and "--hold" in r.stderr and "'-1'" in r.stderr, r.stderr
    assert shm_files() == before  # validated before anything was created
    notjson = tmp_path / "spec.txt"
    notjson.write_text("layer_ids: 1, 14")
    r = cli("bench", "--spec", str(notjson), "--size", "1M")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert f"spec file {str(notjson)!r} is not JSON" in r.stderr, r.stderr


def _maps_a_table(pid: int) -> bool:
    """The process maps a table (a /dev/shm file, or bench's memfd)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "numa-engram-" in f.read()
    except OSError:
        return False


@slow
@pytest.mark.parametrize("command", [["create", "--size", "8M", "--hold", "120"],
                                     ["bench", "--size", "64M", "--repeat", "100000",
                                      "--tokens", "1000"]], ids=["create-hold", "bench"])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_cleans_up_prints_one_line_and_exits_128_plus_it(command, sig):
    import signal
    import time

    from .conftest import shm_files

    before = shm_files()
    # SIGINT at its default, as a terminal starts a command: a test run
    # started in the background (`&`, nohup) passes SIGINT on ignored, and
    # Python then installs no handler for it
    launcher = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "runpy.run_module('numa_engram', run_name='__main__', alter_sys=True)")
    child = subprocess.Popen([sys.executable, "-c", launcher, *command],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _maps_a_table(child.pid) and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.05)
    assert _maps_a_table(child.pid), "the table was never created"
    time.sleep(0.3)  # inside the hold or the lookups
    child.send_signal(getattr(signal, sig))  # the process this test started
    out, err = child.communicate(timeout=60)
    assert child.returncode == 128 + getattr(signal, sig), (child.returncode, err)
    assert err.splitlines() == [f"numa-engram {command[0]}: stopped by {sig}; what it had "
                                "created is removed"], err
    assert shm_files() == before


def test_the_host_failing_is_status_1_a_wrong_request_status_2():
    """A table the tmpfs cannot hold is the host's failure (1), a bad size
    the caller's (2); both one line naming the numbers."""
    out = cli("create", "--size", "100T")
    assert out.returncode == 1 and "needs 102400.00 GiB" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert cli("create", "--size", "1X").returncode == 2
    from numa_engram.cli.app import build_parser

    assert "141" in build_parser().format_help() and "CapacityError" in \
        build_parser().format_help()  # the codes are documented where --help shows them


def test_json_goes_before_or_after_the_command():
    import json

    before, after = cli("--json", "topo"), cli("topo", "--json")
    assert before.returncode == after.returncode == 0
    nodes = [[n["id"], n["cpus"]] for n in json.loads(before.stdout)["nodes"]]
    assert nodes == [[n["id"], n["cpus"]] for n in json.loads(after.stdout)["nodes"]]


@slow
def test_a_reader_that_goes_away_ends_the_output_quietly():
    """`numa-engram topo | head -0`: no 'Broken pipe' message, SIGPIPE's status."""
    proc = subprocess.Popen([sys.executable, "-m", "numa_engram", "topo"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the child writes a byte
    err = proc.stderr.read()
    assert proc.wait(60) == 141 and err == "", err


def test_messages_write_node_sets_and_page_sizes_as_the_tools_take_them():
    """numactl's node form, the CLI's page-size spelling, no internal names."""
    from numa_engram.errors import StorageError, TopologyError
    from numa_engram.host import hugepages
    from numa_engram.host.topology import Topology

    topo = Topology.from_dict({"sockets": 2})
    with pytest.raises(TopologyError, match=r"nodes are 0-1$"):
        topo.node(5)
    with pytest.raises(StorageError) as exc:
        hugepages.find_mount(1 << 40)  # no mount of such pages anywhere
    text = str(exc.value)
    assert "check_pool" not in text and "page_size=" not in text and "4K pages" in text
    assert "nr_hugepages" in text


# ------------------------------------- files that block or never end --

def _bounded_command(*args, timeout=60):
    """The real command under a time and a memory bound: a regression that
    blocks on a FIFO (ignoring SIGTERM inside a native open) or reads a
    device without end fails here, never hangs the run or eats the host."""
    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    try:
        return subprocess.run([sys.executable, "-m", "numa_engram", *args], capture_output=True,
                              text=True, timeout=timeout, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"numa-engram {' '.join(args)} still running after {timeout} s")


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    from numa_engram import EngramSpec, write_synthetic_model

    spec = EngramSpec.small(rows_per_head=100, n_head_per_ngram=2, head_dim=64, max_ngram_size=3)
    return write_synthetic_model(tmp_path_factory.mktemp("good"), spec)


def _spoiled(model_files, tmp_path, name, how):
    """A copy of the model directory whose ``name`` is a FIFO or a symlink
    to /dev/zero."""
    import shutil

    root = tmp_path / "model"
    shutil.copytree(model_files, root)
    (root / name).unlink()
    if how == "fifo":
        os.mkfifo(root / name)
    else:
        (root / name).symlink_to("/dev/zero")
    return root


HOSTILE = [("config.json", "fifo", "the model's config {path} is a FIFO"),
           ("config.json", "zero", "the model's config {path} is a character device"),
           ("tokenizer.json", "fifo", "the tokenizer {path} is a FIFO"),
           ("tokenizer.json", "zero", "the tokenizer {path} is a character device")]


@slow
@pytest.mark.parametrize("name, how, text", HOSTILE, ids=[f"{n}-{h}" for n, h, _ in HOSTILE])
def test_plan_model_refuses_a_fifo_or_device_by_name(model_files, tmp_path, name, how, text):
    root = _spoiled(model_files, tmp_path, name, how)
    r = _bounded_command("plan", "--model", str(root), "--tp", "1")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, (r.returncode, r.stderr)
    assert text.format(path=root / name) in r.stderr, r.stderr


@slow
@pytest.mark.parametrize("how, kind", [("fifo", "a FIFO"), ("zero", "a character device")])
def test_plan_spec_refuses_a_fifo_or_device_by_name(tmp_path, how, kind):
    path = tmp_path / "spec.json"
    if how == "fifo":
        os.mkfifo(path)
    r = _bounded_command("plan", "--spec", str(path) if how == "fifo" else "/dev/zero")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, (r.returncode, r.stderr)
    assert f"the spec file {path if how == 'fifo' else '/dev/zero'} is {kind}" in r.stderr


def test_plan_model_of_a_missing_path_names_that_path(tmp_path):
    missing = tmp_path / "no-such-model"
    r = cli("plan", "--model", str(missing))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert f"--model '{missing}' does not exist or is not a directory" in r.stderr, r.stderr


@slow
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_serve_refuses_a_fifo_config_or_index_by_name(model_files, tmp_path, name):
    """serve with config.json a FIFO exits naming it; with the checkpoint
    index a FIFO it starts, and every table fails naming the index."""
    root = _spoiled(model_files, tmp_path, name, "fifo")
    sock = tmp_path / "s" / "engram.sock"
    if name == "config.json":
        r = _bounded_command("serve", str(root), "--socket", str(sock))
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, (r.returncode, r.stderr)
        assert f"the model's config {root / name} is a FIFO" in r.stderr, r.stderr
        return
    lines, err = _serve_until_loaded(root, sock)
    assert any("0 of 2 tables ready" in x for x in lines), lines
    assert f"the checkpoint index {root / name} is a FIFO" in err, err


def _serve_until_loaded(root, sock):
    """``numa-engram serve root`` until it says how many tables are ready
    (60 s at most), then SIGTERM: its stdout lines and its stderr."""
    import signal
    import threading
    import time

    child = subprocess.Popen([sys.executable, "-m", "numa_engram", "serve", str(root),
                              "--socket", str(sock)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(child.stdout.readline, "")),
                              daemon=True)  # (a blocked serve prints nothing: no read blocks us)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("tables ready" in x for x in lines):
            time.sleep(0.1)
    finally:
        child.send_signal(signal.SIGTERM)  # the process this test started
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        reader.join(timeout=10)
    return lines, child.stderr.read()


@slow
def test_serve_prints_a_model_path_holding_a_newline_escaped(model_files, tmp_path):
    import shutil

    root = tmp_path / "m\nnuma-engram serve: forged"
    shutil.copytree(model_files, root)
    lines, err = _serve_until_loaded(root, tmp_path / "s" / "engram.sock")
    assert lines and "tables ready" in lines[-1], (lines, err)
    assert len(lines) == 2 and not lines[1].startswith("numa-engram serve: forged"), lines
    assert "m\\nnuma-engram serve: forged" in lines[0], lines
