"""SocketGroup: members meeting at a Unix socket with no torch, in real
processes (tests/support/socketworld.py), and its refusals in this process."""

import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from numa_engram.checkpoints.synthetic import write_raw_checkpoint
from numa_engram.errors import GroupTimeout, NumaEngramError, StorageError, TopologyError
from numa_engram.groups.group import Group, as_group
from numa_engram.groups.socketgroup import SocketGroup

from .support.dist_harness import is_stopped
from .support.socket_scenarios import make_spec
from .support.socketworld import run_socket_world

multiproc = pytest.mark.multiproc


def _ok(results):
    for r in results:
        assert r["ok"], r.get("traceback") or r
        assert not r["torch_imported"], f"rank {r['rank']} imported torch"


@multiproc
def test_members_gather_and_hear_the_leader_and_leave_no_socket_file(tmp_path):
    results = run_socket_world(3, "collectives", meet=str(tmp_path))
    _ok(results)
    pids = [g["pid"] for g in results[0]["gathered"]]
    for r in results:
        assert [g["rank"] for g in r["gathered"]] == [0, 1, 2] and \
            [g["pid"] for g in r["gathered"]] == pids
        assert r["told"] == f"from {pids[0]}" and r["path_gone"]
    assert os.listdir(tmp_path) == []


@multiproc
def test_a_dp_shared_table_over_a_socket_group_is_one_copy_without_torch(tmp_path):
    spec = make_spec(2000)
    ckpt = str(write_raw_checkpoint(tmp_path / "engram.safetensors", spec))
    meet = tmp_path / "meet"
    meet.mkdir()
    results = run_socket_world(2, "share", meet=str(meet), checkpoint=ckpt,
                               rows_per_head=2000)
    _ok(results)
    for r in results:
        assert r["same_as_source"] and r["lookup_exact"] and r["placement"]["ok"], r
        assert r["report"]["mode"] == "dp_shared" and r["report"]["sharing_group"] == [0, 1]
    assert len({r["digest"] for r in results}) == 1
    # one copy: each member's proportional share is half of what it maps
    for r in results:
        assert r["pss"] <= 0.6 * r["rss"], r


@multiproc
@pytest.mark.parametrize("victim", [0, 1], ids=["leader", "member"])
def test_a_killed_member_is_named_at_once_not_after_the_timeout(tmp_path, victim):
    results = run_socket_world(3, "member_fails", meet=str(tmp_path), victim=victim,
                               action="kill", bound_s=60)
    assert results[victim]["error_type"] == "NoResult" and results[victim]["exitcode"] == -9
    for r in results:
        if r["rank"] == victim:
            continue
        assert r["ok"] and not r["torch_imported"], r
        error = r["error"]
        assert error["type"] == "GroupTimeout" and r["elapsed"] < 10, r
        assert ("exited or died" in error["message"]
                and (f"world rank {victim}" in error["message"])), error


@multiproc
def test_a_stopped_member_is_named_by_the_leader_and_the_others_hear_why(tmp_path):
    results = run_socket_world(3, "member_fails", meet=str(tmp_path), victim=2, action="stop",
                               bound_s=2, resume_stopped=True)
    leader, member = results[0], results[1]
    for r in (leader, member):
        assert r["ok"] and r["error"]["type"] == "GroupTimeout" and r["elapsed"] < 10, r
        assert "member(s) at world rank(s) [2] did not arrive" in r["error"]["message"], r
        assert "step 'after-join'" in r["error"]["message"]
    # resumed, it finds the group broken, not a hang
    assert results[2]["ok"] and results[2]["error"]["type"] == "GroupTimeout", results[2]


@multiproc
def test_a_member_that_never_joins_is_named_and_the_path_removed(tmp_path):
    results = run_socket_world(3, "never_joins", meet=str(tmp_path), bound_s=2)
    for r in results[:2]:  # the leader, and the member it told why
        assert r["error_type"] == "GroupTimeout", r
        assert "member(s) at world rank(s) [2] did not join within 2 s" in r["message"], r
    assert results[2]["ok"]
    assert os.listdir(tmp_path) == []


@multiproc
def test_members_at_different_steps_fail_naming_both(tmp_path):
    results = run_socket_world(3, "mismatched", meet=str(tmp_path))
    assert results[0]["error_type"] == "NumaEngramError", results[0]
    assert ("world rank 1 is at step 'map'" in results[0]["message"]
            and "step 'load'" in results[0]["message"])
    for r in results[1:]:  # told by the leader why the group broke
        assert r["error_type"] == "GroupTimeout" and "'map'" in r["message"], r


@multiproc
@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to run a member as another uid")
def test_a_member_of_another_user_is_refused_before_anything_is_read():
    with tempfile.TemporaryDirectory() as meet:  # (pytest's tmp_path is root's alone)
        os.chmod(meet, 0o777)
        results = run_socket_world(2, "other_user", meet=meet)
        assert os.listdir(meet) == []
    member = results[1]
    assert member["error_type"] == "NumaEngramError", member
    assert "runs as uid 0 and takes no member of uid 65534" in member["message"], member
    assert results[0]["error_type"] == "GroupTimeout"  # still waiting for a member of its own


def test_a_socket_group_is_a_group_and_one_member_needs_no_socket(tmp_path):
    group = SocketGroup(tmp_path / "g.sock", 0, 1)
    assert isinstance(group, Group) and as_group(group) is group
    assert group.all_gather("x", "s") == ["x"] and group.broadcast(3, "s") == 3
    assert group.process_group is None and group.ranks == (0,)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, text", [((2, 2), "0 <= rank < size"), ((0, 0), "size >= 1"),
                                        ((0, 2, (1, 1)), "distinct")])
def test_bad_ranks_are_refused(tmp_path, args, text):
    rank, size, *ranks = args
    with pytest.raises(ValueError, match=text):
        SocketGroup(tmp_path / "g.sock", rank, size, ranks=ranks[0] if ranks else None)


@pytest.mark.parametrize("kwargs, text", [
    (dict(rank="0"), "rank '0' and size 2 must be integers"),
    (dict(size=None), "rank 0 and size None must be integers"),
    (dict(ranks=["a", "b"]), r"ranks \['a', 'b'\] must be a sequence"),
    (dict(ranks=5), "ranks 5 must be a sequence"),
    (dict(timeout_s=-1), "timeout_s -1 must be a finite number"),
    (dict(timeout_s=math.nan), "timeout_s nan must be a finite number"),
    (dict(timeout_s=math.inf), "timeout_s inf must be a finite number"),
    (dict(timeout_s="5"), "timeout_s '5' must be a finite number"),
    (dict(identity=3), "identity 3 must be a str"),
    (dict(path=None), "the group's path None must be a str"),
    (dict(path=b"/tmp/g.sock"), r"the group's path b'/tmp/g.sock' must be a str"),
    (dict(path="/tmp/a\0b"), r"path '/tmp/a\\x00b' must be a non-empty path without NUL"),
    (dict(path=""), "path '' must be a non-empty path"),
])
def test_hostile_arguments_are_refused_naming_the_value(tmp_path, kwargs, text):
    args = dict(path=tmp_path / "g.sock", rank=0, size=2, timeout_s=1.0) | kwargs
    with pytest.raises(TopologyError, match=text):
        SocketGroup(args.pop("path"), args.pop("rank"), args.pop("size"), **args)
    assert os.listdir(tmp_path) == []


LEADER = """
import sys
from numa_engram.groups.socketgroup import SocketGroup
SocketGroup(sys.argv[1], 0, 2, timeout_s=120)
"""


@multiproc
def test_a_stopped_leader_with_a_full_listen_queue_is_a_timeout_within_the_bound(tmp_path):
    """The leader's process is stopped (SIGSTOP) and its listen queue full:
    a joining member's connect() used to wait until the leader ran again;
    it gives up at its timeout_s, saying why."""
    path = str(tmp_path / "g.sock")
    leader = subprocess.Popen([sys.executable, "-c", LEADER, path])
    fillers, member = [], None
    try:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        while probe.connect_ex(path):  # until the leader listens
            assert leader.poll() is None, "the leader exited"
            time.sleep(0.01)
        fillers.append(probe)  # silent: the leader waits on its hello, then on nobody
        os.kill(leader.pid, signal.SIGSTOP)
        while not is_stopped(leader.pid):
            time.sleep(0.01)
        while True:  # fill the stopped leader's listen queue
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.setblocking(False)
            fillers.append(filler)
            try:
                filler.connect(path)
            except BlockingIOError:
                break
        member, out = _join(path, 1, 2, timeout_s=1.0)
        started = time.monotonic()
        member.join(timeout=15)
        assert not member.is_alive(), "the member's connect() ignores its timeout_s"
        assert time.monotonic() - started < 5
        assert isinstance(out[0], GroupTimeout), out
        assert "its listen queue is full (it is stopped, hung or slow)" in str(out[0])
        assert f"at {path!r} took no connection within 1 s" in str(out[0])
    finally:
        leader.kill()  # a member still blocked in connect() (before the fix) is refused now
        leader.wait()
        for sock in fillers:
            sock.close()
        if member is not None:
            member.join(timeout=30)


@pytest.mark.parametrize("mode, text", [
    (0o000, "is a socket of uid 0 that this user (uid {uid}) may not connect to"),
    (0o777, "is a dead listener's socket of uid 0, which this user (uid {uid}) may not remove"),
], ids=["cannot-probe", "cannot-remove"])
def test_another_users_dead_socket_is_a_library_error_naming_it(mode, text):
    """A dead socket the joining user may not probe or remove (another
    user's, in a directory it may not write): a StorageError naming the
    path and what to do, not a raw PermissionError.  As root the attempt is
    made as uid 65534 (root may remove anything)."""
    with tempfile.TemporaryDirectory() as meet:  # (pytest's tmp_path is root's alone)
        path = os.path.join(meet, "g.sock")
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(path)
        stale.close()
        os.chmod(path, mode)
        os.chmod(meet, 0o555)
        try:
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # the other user, in a child: its uid cannot come back
                os.close(read_end)
                try:
                    if os.getuid() == 0:
                        os.setuid(65534)
                    SocketGroup(path, 0, 2, timeout_s=1.0)
                    said = "joined"
                except BaseException as exc:
                    said = f"{type(exc).__name__}|{os.getuid()}|{exc}"
                os.write(write_end, said.encode())
                os._exit(0)
            os.close(write_end)
            with os.fdopen(read_end, "rb") as f:
                kind, uid, message = f.read().decode().split("|", 2)
            os.waitpid(pid, 0)
        finally:
            os.chmod(meet, 0o755)
        assert os.path.exists(path)  # left as it was
    assert kind == StorageError.__name__, (kind, message)
    assert repr(path) in message and text.format(uid=uid) in message, message
    assert "remove it as its owner" in message and "or choose another path" in message


def _join(path, rank, size, timeout_s=5.0):
    """Join in a thread; (group or exception) in the returned list."""
    out = []

    def run():
        try:
            out.append(SocketGroup(path, rank, size, timeout_s=timeout_s))
        except Exception as exc:
            out.append(exc)
    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_stale_socket_is_replaced_and_a_live_one_or_a_file_refused(tmp_path):
    path = tmp_path / "g.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, no one listens: a dead leader's
    thread, out = _join(path, 1, 2)
    leader = SocketGroup(path, 0, 2, timeout_s=5)
    thread.join()
    assert isinstance(out[0], SocketGroup) and not path.exists()
    out[0].close()
    leader.close()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(1)
    with pytest.raises(NumaEngramError, match="in use by a live group"):
        SocketGroup(path, 0, 2, timeout_s=1)
    live.close()
    os.unlink(path)
    path.write_text("not a socket")
    with pytest.raises(NumaEngramError, match="exists and is not a socket"):
        SocketGroup(path, 0, 2, timeout_s=1)
    assert path.read_text() == "not a socket"  # left as it was


def test_a_second_member_with_a_taken_rank_or_another_size_is_told_why(tmp_path):
    path = tmp_path / "g.sock"
    leading, led = _join(path, 0, 3)
    ones, wrong = [_join(path, 1, 3), _join(path, 1, 3)], _join(path, 2, 4)
    wrong[0].join()
    while all(thread.is_alive() for thread, _ in ones):  # until the second one is refused
        threading.Event().wait(0.01)
    third = _join(path, 2, 3)  # the group is whole only now
    for thread, _ in [*ones, third, (leading, led)]:
        thread.join()
    rank_1s = [ones[0][1][0], ones[1][1][0]]  # whichever came second is refused
    refused = [g for g in rank_1s if isinstance(g, NumaEngramError)]
    assert len(refused) == 1 and "rank 1 has already joined" in str(refused[0]), rank_1s
    assert isinstance(wrong[1][0], NumaEngramError), wrong[1]
    assert "as rank 2 of 4" in str(wrong[1][0]) and "this group has 3 members" in str(
        wrong[1][0])
    got = [g for g in rank_1s if isinstance(g, SocketGroup)]
    third_got, leader = third[1], led[0]
    for g in (got[0], third_got[0], leader):
        assert isinstance(g, SocketGroup), g
    ranks = {}

    def gather(g):
        ranks[g.rank] = g.all_gather(g.rank, "after")
    threads = [threading.Thread(target=gather, args=(g,)) for g in (got[0], third_got[0])]
    for t in threads:
        t.start()
    ranks[0] = leader.all_gather(0, "after")
    for t in threads:
        t.join()
    assert ranks == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    for g in (got[0], third_got[0], leader):
        g.close()


def test_a_broken_group_says_so_at_the_next_step(tmp_path):
    path = tmp_path / "g.sock"
    thread, out = _join(path, 1, 2)
    leader = SocketGroup(path, 0, 2, timeout_s=5)
    thread.join()
    out[0].close()  # the member leaves
    with pytest.raises(GroupTimeout, match="world rank 1 .* closed its connection"):
        leader.all_gather(0, "load")
    with pytest.raises(GroupTimeout, match="step 'next'.* is broken"):
        leader.barrier("next")


def test_a_path_too_long_for_a_unix_socket_is_refused_naming_the_limit(tmp_path):
    with pytest.raises(ValueError, match="at most 107: choose a shorter directory"):
        SocketGroup(tmp_path / ("d" * 120) / "g.sock", 0, 2)


def test_a_connection_that_says_nothing_does_not_hold_the_group(tmp_path, monkeypatch):
    from numa_engram.groups import socketgroup

    monkeypatch.setattr(socketgroup, "_HELLO_S", 0.2)
    path = tmp_path / "g.sock"
    leading, led = _join(path, 0, 2)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    while silent.connect_ex(str(path)):  # until the leader listens
        threading.Event().wait(0.01)
    member, got = _join(path, 1, 2)
    for thread in (member, leading):
        thread.join()
    silent.close()
    assert isinstance(led[0], SocketGroup) and isinstance(got[0], SocketGroup), (led, got)
    led[0].close()
    got[0].close()


def test_a_leader_that_never_comes_is_a_timeout_naming_the_path(tmp_path):
    with pytest.raises(GroupTimeout, match=r"no leader \(world rank 0\) listened at .*g.sock "
                                           r"within 0 s"):
        SocketGroup(tmp_path / "g.sock", 1, 2, timeout_s=0.3)
