"""The numa-engram tools' output and effects, through ``main(argv)`` in
this process (what the command line runs; tests/test_cli_errors.py runs
the real command for exit codes and signals)."""

import io
import json
import os
import subprocess
import sys

import pytest

from .conftest import cli_in_process as cli
from .conftest import shm_files


def test_topo_reads_like_numactl_and_answers_json():
    text = cli("topo").stdout
    assert "available:" in text and "node distances:" in text
    doc = json.loads(cli("topo", "--json").stdout)
    assert doc["nodes"][0]["id"] == 0 and doc["nodes"][0]["cpus"]
    sim = json.loads(cli("topo", "--simulate", "2x4", "--json").stdout)
    assert [g["numa_node"] for g in sim["gpus"]] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_tools_start_without_torch():
    code = ("import sys, numa_engram.cli.app as c; c.main(['topo', '--json']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_plan_numbers_for_a_simulated_dual_socket_host():
    doc = json.loads(cli("plan", "--simulate", "2x4", "--tp", "2", "--dp", "4", "--json").stdout)
    mem = doc["mode_memory"]
    assert mem["independent"]["0"] == 4 * mem["dp_shared"]["0"]
    assert doc["remote_fraction"] == 0.5  # sharing groups span both sockets
    rep = json.loads(cli("plan", "--simulate", "2x4", "--tp", "2", "--dp", "4", "--policy",
                         "replicate-per-node", "--json").stdout)
    assert rep["remote_fraction"] == 0.0
    assert rep["bytes_per_node"]["0"] == rep["bytes_per_node"]["1"] == mem["dp_shared"]["0"]


def test_create_verify_and_report():
    doc = json.loads(cli("create", "--size", "8M", "--policy", "node:0", "--json").stdout)
    assert doc["report"]["ok"] and doc["report"]["fraction_on_plan"] == 1.0
    bad = cli("create", "--size", "8M", "--policy", "node:9", check=False)
    assert bad.returncode == 2 and "node 9 does not exist" in bad.stderr


def test_verify_a_live_table_file_from_another_process():
    from numa_engram.store.fileformat import Layout
    from numa_engram.store.placement import PlacementPlan, PlacementRange
    from numa_engram.store.storage import BackingFile

    layout = Layout.of([("w", 1 << 20)])
    plan = PlacementPlan((PlacementRange("w", layout.regions[0].offset, 1 << 20, "bind", (0,)),))
    with BackingFile.create(layout, bytes(32), placement=plan) as f:
        doc = json.loads(cli("verify", f.path, "--json").stdout)
        assert doc["state"] == "CREATING" and doc["report"]["ok"] and doc["holder"] == "in use"
        assert doc["report"]["ranges"][0]["pages_per_node"] == {"0": 256}


def test_verify_every_table_of_a_running_process():
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom numa_engram import EngramSpec, SharedEngramTable, shard_heads\n"
        "spec = EngramSpec.small()\n"
        "t = [SharedEngramTable.create(spec, l, shard_heads(spec.bucket_sizes(l), 1, 0))"
        " for l in spec.layer_ids]\nprint('ready', flush=True)\ntime.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        docs = json.loads(cli("verify", "--pid", str(holder.pid), "--json").stdout)
        assert len(docs) == 2 and all(d["state"] == "READY" and d["report"]["ok"] for d in docs)
        assert all("memfd:numa-engram-" in d["table"] for d in docs)
    finally:
        os.kill(holder.pid, 9)
        holder.wait()
    none = cli("verify", "--pid", str(os.getpid()), check=False)
    assert none.returncode == 2 and "holds no numa_engram table" in none.stderr


def test_gc_and_mem():
    dead = subprocess.run([sys.executable, "-c", (
        "import os, signal\n"
        "from numa_engram.store.fileformat import Layout\n"
        "from numa_engram.store.storage import BackingFile\n"
        "f = BackingFile.create(Layout.of([('w', 4096)]), bytes(32))\nprint(f.path, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)")], capture_output=True, text=True)
    path = dead.stdout.strip()
    assert os.path.exists(path)
    assert "creator dead: no process holds it" in cli("verify", path).stdout
    dry = json.loads(cli("gc", "--dry-run", "--json").stdout)
    assert any(e["path"] == path and not e["removed"] for e in dry)
    assert "removed" in cli("gc").stdout and not os.path.exists(path)
    mem = json.loads(cli("mem", str(os.getpid()), "--json").stdout)
    assert mem["processes"][0]["pid"] == os.getpid() and mem["tmpfs_total"] > 0


@pytest.mark.multiproc
def test_demo_shares_one_copy_between_two_replicas():
    before = shm_files()
    out = cli("demo", "--spec", "tiny", "--procs", "2", "--steps", "6")
    assert "through EngramRuntime" in out.stdout and "restored request" in out.stdout
    assert "mode dp_shared" in out.stdout and "bit-exact True" in out.stdout
    assert "(sharing group: ranks [0, 1])" in out.stdout  # ranks, not a node list
    assert "startup" in out.stdout and "populate" in out.stdout and "proved" in out.stdout
    assert "= 1.00 copies" in out.stdout, out.stdout
    assert shm_files() == before


@pytest.mark.multiproc
def test_demo_serves_a_model_directory_given_to_it(tmp_path):
    from numa_engram import EngramSpec, write_synthetic_model

    model = write_synthetic_model(tmp_path / "model", EngramSpec.small(rows_per_head=300,
                                                                        max_ngram_size=4))
    doc = json.loads(cli("demo", "--model", str(model), "--steps", "5", "--json").stdout)
    assert doc["ok"] and all(r["exact"] and r["steps"] == 5 for r in doc["replicas"])
    assert str(model) in doc["text"] and "= 1.00 copies" in doc["text"]
    assert {"read", "checks", "map", "load"} <= set(doc["replicas"][1]["report"]["startup_s"])


def _on_a_terminal(*args):
    """Run numa-engram with stderr on a pseudo-terminal; (rc, stderr text)."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "numa_engram.cli.app", *args],
                            stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(120)
    os.close(leader)
    return proc.returncode, b"".join(chunks).decode()


@pytest.mark.slow  # starts an interpreter (~1 s)
def test_progress_bar_only_on_a_terminal_and_never_with_json():
    rc, err = _on_a_terminal("create", "--size", "200M")
    assert rc == 0 and "populate [" in err and "ETA" in err and "/s" in err, err
    rc, err = _on_a_terminal("create", "--size", "200M", "--json")
    assert rc == 0 and "populate" not in err, err
    piped = cli("create", "--size", "200M")
    assert "populate" not in piped.stderr


def test_progress_callback_follows_populate():
    from numa_engram.store.fileformat import Layout
    from numa_engram.store.storage import BackingFile

    seen = []
    with BackingFile.create(Layout.of([("w", 200 << 20)]), bytes(32),
                            progress=lambda d, t: seen.append((d, t))):
        pass
    assert seen[-1] == (seen[-1][1], seen[-1][1]) and len(seen) >= 3
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_mem_and_verify_read_like_numastat():
    from numa_engram.store.fileformat import Layout
    from numa_engram.store.storage import BackingFile

    with BackingFile.create(Layout.of([("w", 48 << 20)]), bytes(32)) as f:
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys\nfrom numa_engram.store.storage import BackingFile\n"
             "from numa_engram.bindings import native\n"
             f"b = BackingFile.attach({f.path!r})\n"
             "native.madvise(b.mapping, native.MADV_POPULATE_READ)\n"
             "print('ready', flush=True)\nsys.stdin.readline()\n"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            mem = cli("mem", str(child.pid)).stdout.splitlines()
            verified = cli("verify", "--pid", str(child.pid)).stdout
        finally:
            child.communicate("\n", timeout=60)
    assert mem[0].startswith("memory in MiB")  # one unit, named once
    header = mem[1].split()
    assert header[:4] == ["pid", "RSS", "PSS", "PSS"] and "Node" in header
    total = next(line for line in mem if line.startswith("Sum"))
    mapped = float(mem[2].split()[-1])  # the table's pages on the (last) node
    assert mapped >= 47.9 and float(total.split()[-1]) == mapped
    assert any(line.startswith("Shmem") for line in mem)
    assert any(line.startswith("Hugetlb") for line in mem)
    assert "(MiB)" in verified and "Total" in verified and "pages of 4 KiB: Node" in verified


def test_progress_off_a_terminal_is_plain_lines_never_carriage_returns():
    from numa_engram.progress import terminal_bar

    log = io.StringIO()
    bar = terminal_bar("load", log)
    for done in range(0, 101):
        bar(done << 20, 100 << 20)
    text = log.getvalue()
    assert "\r" not in text and 2 <= len(text.splitlines()) <= 6, text
    assert text.splitlines()[-1].startswith("load [" + "#" * 30 + "] 100.00 MiB of 100.00 MiB")


def test_gc_says_why_once_without_padding(tmp_path):
    short = tmp_path / "numa-engram-0123456789abcdef"
    short.write_bytes(b"x" * 100)
    lines = cli("gc", "--dry-run", "--directory", str(tmp_path)).stdout.splitlines()
    assert lines[0].split() == ["verdict", "file", "KiB", "why"]
    assert lines[1].endswith("0.10  is too short (100 bytes) to be a numa_engram backing file")
    assert lines[1].count(str(short)) == 1 and "skipped" not in lines[1].split("0.10")[1]


@pytest.mark.serial  # every process's tables: another worker's too
def test_mem_and_verify_without_arguments_find_every_live_table(tmp_path):
    """A table held by the console script (`numa-engram create --hold`) and
    one by a worker whose command line never names us (as torchrun starts
    it): `mem` lists both processes, `verify` checks both tables, once each."""
    worker = tmp_path / "worker.py"
    worker.write_text("import sys, time\nfrom numa_engram import EngramSpec, SharedEngramTable, "
                      "shard_heads\nspec = EngramSpec.small()\n"
                      "t = SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1,"
                      " 0), directory=None)\nprint('ready', flush=True)\ntime.sleep(120)\n")
    script = os.path.join(os.path.dirname(sys.executable), "numa-engram")
    held = subprocess.Popen([script, "create", "--size", "8M", "--hold", "120"],
                            stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, str(worker)], stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline() and other.stdout.readline().strip() == "ready"
        mem = json.loads(cli("mem", "--json").stdout)
        assert {held.pid, other.pid} <= {p["pid"] for p in mem["processes"]}, mem
        docs = json.loads(cli("verify", "--json").stdout)
        mine = [d for d in docs if f"pid {held.pid} " in d["table"]
                or f"pid {other.pid} " in d["table"]]
        assert len(mine) == 2 and all(d["report"]["ok"] for d in mine), docs
        assert {d["state"] for d in mine} == {"READY"}  # create marks what it made ready
    finally:
        held.terminate()  # SIGTERM: create removes its file on the way out
        other.kill()
        for p in (held, other):
            p.wait(60)


def test_mem_counts_a_shared_table_once_in_its_pss_total():
    """Two processes and this one map one 48 MiB table: each process's rows
    count it whole, the PSS total counts each page once (two thirds here)."""
    from numa_engram.store.fileformat import Layout
    from numa_engram.store.storage import BackingFile

    size = 48 << 20
    code = ("import sys\nfrom numa_engram.store.storage import BackingFile\n"
            "from numa_engram.bindings import native\n"
            "b = BackingFile.attach(sys.argv[1])\n"
            "native.madvise(b.mapping, native.MADV_POPULATE_READ)\n"
            "print('ready', flush=True)\nsys.stdin.readline()\n")
    from numa_engram.bindings import native

    with BackingFile.create(Layout.of([("w", size)]), bytes(32)) as f:
        native.madvise(f.mapping, native.MADV_POPULATE_READ)  # this process maps every page too
        children = [subprocess.Popen([sys.executable, "-c", code, f.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True) for _ in range(2)]
        try:
            assert all(c.stdout.readline().strip() == "ready" for c in children)
            doc = json.loads(cli("mem", *(str(c.pid) for c in children), "--json").stdout)
            text = cli("mem", *(str(c.pid) for c in children)).stdout
        finally:
            for c in children:
                c.communicate("\n", timeout=60)
    rss = sum(p["table_rss"] for p in doc["processes"])
    assert abs(rss - 2 * size) < (1 << 20)  # each process counts the whole table
    assert abs(doc["table_pss_total"] - 2 * size / 3) < (1 << 20)  # each page once (3 mappers)
    assert "Sum: over the processes" in text and "tables: PSS over these processes" in text
