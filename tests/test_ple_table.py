"""PLE tables held as Engram tables are: made by the sharing protocol from
vLLM's split-parts checkpoint, one copy per sharing group, on 4K or 2M
pages; rows compared with the safetensors library's read of the checkpoint
and vLLM's dequantisation rule, atol 0."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from numa_engram.checkpoints.synthetic import synthetic_scale, write_ple_checkpoint
from numa_engram.errors import CheckpointError, LookupIdError, StorageError, TopologyError
from numa_engram.model.ple import PLESpec
from numa_engram.tables.pletable import SharedPLETable

from .support import ple_scenarios
from .support.dist_harness import run_world

torch = pytest.importorskip("torch")

SPEC = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
               ngram_vocab_size_base=3000, split_ngram_parts=7)
LAYER = ple_scenarios.LAYER


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ple") / "model.safetensors"
    return str(write_ple_checkpoint(path, SPEC, seed=11))


def test_a_private_table_holds_the_checkpoints_rows_and_scale(ckpt):
    weight, scale = ple_scenarios.whole_table(ckpt, SPEC, LAYER)
    assert scale == synthetic_scale(SPEC, LAYER)
    rows = SPEC.rows(LAYER)
    ids = np.random.default_rng(0).integers(0, rows, size=(40, SPEC.n_heads))
    with SharedPLETable.create(SPEC, LAYER, checkpoint=ckpt, mode="independent") as table:
        assert table.scale == scale and table.mode == "independent"
        assert np.array_equal(table.weights, weight.view(torch.uint8).numpy())
        got = table.lookup(ids).view(torch.int16).numpy().view(np.uint16)
        want = ple_scenarios.vllm_rows(weight, scale, ids)
        assert np.array_equal(np.where(got == 0x7FC0, 0x7FC0, got), want)
        with pytest.raises(LookupIdError, match=f"{rows}"):
            table.lookup([rows])
        out = torch.empty((40, SPEC.n_heads, SPEC.head_dim), dtype=torch.bfloat16)
        assert table.lookup(ids, out) is out
        assert torch.equal(out.view(torch.int16), table.lookup(ids).view(torch.int16))
        with pytest.raises(ValueError, match=r"shape \[40, 16, 10\], got torch.bfloat16 \[40, 16, "
                                             r"9\]"):
            table.lookup(ids, out[..., :9].contiguous())
        with pytest.raises(ValueError, match=r"CPU bfloat16 tensor of shape \[40, 16, 10\], got "
                                             r"torch.float32"):
            table.lookup(ids, out.float())
        with pytest.raises(StorageError, match="register_device=<cuda device index>"):
            table.lookup_cuda(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(StorageError, match="closed"):
        table.lookup([0])


def test_a_row_range_shard_reads_its_rows_and_zeros_for_the_others(ckpt):
    weight, _ = ple_scenarios.whole_table(ckpt, SPEC, LAYER)
    start, end = SPEC.shard_rows(LAYER, 1, 2)
    with SharedPLETable.create(SPEC, LAYER, etp_rank=1, etp_size=2, checkpoint=ckpt,
                               mode="independent") as table:
        assert (table.shard.row_start, table.shard.row_end) == (start, end)
        assert np.array_equal(table.weights, weight[start:end].view(torch.uint8).numpy())
        packed = table.lookup_packed([0, start, end - 1, start - 1])
        assert not packed[0].any() and not packed[3].any()
        assert np.array_equal(packed[1:3], weight[[start, end - 1]].view(torch.uint8).numpy())


def test_bf16_tables_load_and_look_up(tmp_path):
    spec = PLESpec(**{**SPEC.to_dict(), "dtype": "bfloat16"})
    path = str(write_ple_checkpoint(tmp_path / "bf16.safetensors", spec, seed=2))
    from safetensors.torch import load_file

    tensors = load_file(path)
    prefix = f"model.layers.{LAYER - 1}.ple.ple_embedding.ngram_embedding."
    whole = torch.cat([tensors[f"{prefix}shard_{i}.weight"]
                       for i in range(spec.split_ngram_parts)])
    ids = np.arange(0, spec.rows(LAYER), 97)
    with SharedPLETable.create(spec, LAYER, checkpoint=path, mode="independent") as table:
        assert table.scale is None
        assert torch.equal(table.lookup(ids).view(torch.int16),
                           whole[torch.from_numpy(ids)].view(torch.int16))


def _rewrite_header(src: str, dst, change) -> str:
    data = Path(src).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    # the data block moves with the header: offsets stay relative to it
    dst.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    return str(dst)


def test_a_bad_checkpoint_is_refused_naming_the_tensor(ckpt, tmp_path):
    prefix = f"model.layers.{LAYER - 1}.ple.ple_embedding.ngram_embedding."
    missing = _rewrite_header(ckpt, tmp_path / "a.safetensors",
                              lambda h: h.pop(f"{prefix}shard_3.weight"))
    with pytest.raises(CheckpointError, match="part 3 of 7"):
        SharedPLETable.create(SPEC, LAYER, checkpoint=missing, mode="independent")
    no_scale = _rewrite_header(ckpt, tmp_path / "b.safetensors",
                               lambda h: h.pop(f"{prefix}weight_scale"))
    with pytest.raises(CheckpointError, match="no weight_scale"):
        SharedPLETable.create(SPEC, LAYER, checkpoint=no_scale, mode="independent")

    def bf16(h: dict) -> None:
        h[f"{prefix}shard_0.weight"]["dtype"] = "I8"
    wrong = _rewrite_header(ckpt, tmp_path / "c.safetensors", bf16)
    with pytest.raises(CheckpointError, match="shard_0.weight.*I8"):
        SharedPLETable.create(SPEC, LAYER, checkpoint=wrong, mode="independent")
    with pytest.raises(TopologyError, match="rank 2 is not in an ETP group of 2"):
        SharedPLETable.create(SPEC, LAYER, etp_rank=2, etp_size=2, mode="independent")


def test_on_2m_huge_pages(ckpt, huge_pool):
    weight, _ = ple_scenarios.whole_table(ckpt, SPEC, LAYER)
    with SharedPLETable.create(SPEC, LAYER, checkpoint=ckpt, mode="independent",
                               directory=huge_pool.mount, page_size="2M") as table:
        assert table.backing.mapping.page_size == 2 << 20
        assert np.array_equal(table.weights, weight.view(torch.uint8).numpy())


@pytest.mark.multiproc
@pytest.mark.parametrize("page", ["4K", pytest.param("2M", marks=pytest.mark.serial)])
def test_tp2_dp2_one_copy_per_tp_shard_rows_equal_a_single_process_reference(ckpt, page,
                                                                              request):
    """Four ranks as vLLM's TP 2 x DP 2 (ETP = TP): the two replicas of each
    TP rank share one copy of its row range (PSS summed over them is one
    copy), and each replica's rows, all-reduced over its TP pair, equal the
    whole table's rows under vLLM's rule."""
    directory = "/dev/shm"
    if page == "2M":
        directory = request.getfixturevalue("huge_pool").mount
    results = run_world(4, ple_scenarios.tp2_dp2_shared, timeout_s=240, checkpoint=ckpt,
                        spec=SPEC.to_dict(), directory=directory, page_size=page)
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["exact"] and r["values"] == 64 * SPEC.n_heads * SPEC.head_dim
        assert r["mode"] == "dp_shared"
    for tp_rank in (0, 1):
        members = [results[tp_rank], results[2 + tp_rank]]
        assert all(m["group"] == [tp_rank, 2 + tp_rank] for m in members)
        assert members[0]["rows"] == list(SPEC.shard_rows(LAYER, tp_rank, 2))
        if page == "4K":
            pss, one = sum(m["pss"] for m in members), members[0]["backing_bytes"]
            assert abs(pss - one) <= 0.05 * one, (tp_rank, pss, one)
    if page == "2M":  # hugetlb pages are in no PSS: the pool gave one copy per TP shard
        one_each = results[0]["backing_bytes"] + results[1]["backing_bytes"]
        assert {r["huge_pages_taken"] for r in results} == {one_each // (2 << 20)}, results


@pytest.fixture
def ple_model(tmp_path):
    """A Qwen4-Exp model directory: config.json and the split-parts checkpoint."""
    return ple_scenarios.write_ple_model(tmp_path / "qwen4-exp", SPEC)


def test_the_service_serves_a_ple_model_and_an_engine_attaches(ple_model, tmp_path):
    """``TableService`` over a Qwen4-Exp directory (TP 2): every table loaded
    and sealed; an engine's attach maps its row range read-only, rows equal
    the checkpoint's; a second service start adopts the stored descriptors
    by their names, which differ per row range."""
    from numa_engram.runtime.plemodeldir import PLEModelDirectory
    from numa_engram.service.tableservice import TableService

    model = PLEModelDirectory.open(ple_model)
    assert model.spec == SPEC
    sock = str(tmp_path / "run" / "engram.sock")
    service = TableService(model, sock, tp=2)
    names = {t.name(SPEC.fingerprint, service.page_size) for t in service.tables}
    assert len(names) == len(service.tables) == 2 * len(SPEC.layer_ids)
    service.start()
    try:
        service.load_all()
        status = service.status()
        assert status["ready"] and all(t["sealed"] for t in status["tables"]), status
        weight, scale = ple_scenarios.whole_table(str(ple_model / "model.safetensors"), SPEC,
                                                  LAYER)
        for rank in (0, 1):
            start, end = SPEC.shard_rows(LAYER, rank, 2)
            with SharedPLETable.attach(SPEC, LAYER, service=sock, etp_rank=rank,
                                       etp_size=2) as table:
                assert table.mode == "service" and table.scale == scale
                assert not table.backing.mapping.writable
                assert np.array_equal(table.weights,
                                      weight[start:end].view(torch.uint8).numpy())
    finally:
        service.stop()


@pytest.mark.slow  # starts an interpreter (~1 s)
def test_serve_and_plan_read_a_ple_model_directory(ple_model, tmp_path):
    """The command line: ``plan --model`` reads the PLE config; ``serve``
    loads every table of it and ``status`` says they are ready."""
    import signal
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "numa_engram", "plan", "--model",
                          str(ple_model), "--simulate", "2x2", "--tp", "2", "--dp", "2",
                          "--mode", "dp_shared"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "PLE row ranges" in out.stdout and "vLLM 0.31.0 holds PLE tables per rank" in \
        out.stdout
    sock = str(tmp_path / "run" / "ple.sock")
    proc = subprocess.Popen([sys.executable, "-m", "numa_engram", "serve", str(ple_model),
                             "--socket", sock, "--tp", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert "4 tables" in proc.stdout.readline()
        status = None
        for _ in range(300):
            status = subprocess.run([sys.executable, "-m", "numa_engram", "status", "--socket",
                                     sock, "--json"], capture_output=True, text=True, timeout=60)
            if status.returncode == 0:
                break
        assert status is not None and status.returncode == 0, status
        doc = json.loads(status.stdout)
        assert len(doc["tables"]) == 4 and all(t["sealed"] for t in doc["tables"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_verify_and_mem_read_a_processes_ple_tables(ckpt):
    """The operator's tools on a process holding PLE tables (two ETP row
    ranges, placed on node 0): verify reports each table's weights and
    scale regions on plan, mem counts the tables' pages by node."""
    import os
    import subprocess
    import sys

    from .test_cli import cli

    code = ("import sys, time\nfrom numa_engram.model.ple import PLESpec\n"
            "from numa_engram.tables.pletable import SharedPLETable\n"
            f"spec = PLESpec.from_dict({SPEC.to_dict()!r})\n"
            f"t = [SharedPLETable.create(spec, {LAYER}, etp_rank=r, etp_size=2, "
            f"checkpoint={ckpt!r}, mode='independent', placement='node:0') for r in (0, 1)]\n"
            "print('ready', flush=True)\ntime.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        docs = json.loads(cli("verify", "--pid", str(holder.pid), "--json").stdout)
        assert len(docs) == 2 and all(d["state"] == "READY" and d["report"]["ok"] for d in docs)
        for doc in docs:
            ranges = {r["name"]: r for r in doc["report"]["ranges"]}
            assert set(ranges) == {"weights", "scale"} and ranges["scale"]["length"] == 4
            assert ranges["weights"]["length"] == SPEC.shard_bytes(LAYER, 2, 0) - 4
            assert all(r["planned_nodes"] == [0] and r["fraction_on_plan"] == 1.0
                       for r in ranges.values())
        mem = json.loads(cli("mem", str(holder.pid), "--json").stdout)
        (proc,) = mem["processes"]
        table_bytes = sum(SPEC.shard_bytes(LAYER, 2, r) for r in (0, 1))
        assert proc["pid"] == holder.pid and proc["table_rss"] >= table_bytes
        assert proc["bytes_per_node"] == {"0": proc["table_rss"]}
    finally:
        os.kill(holder.pid, 9)
        holder.wait()


def test_a_ple_tables_lookups_and_placement_are_scraped_as_an_engram_tables(ckpt):
    """The Prometheus collector over a PLE table: lookups, rows, bytes and
    refused ids counted, the last placement report's figures, ready."""
    prometheus_client = pytest.importorskip("prometheus_client",
                                            reason="the 'prometheus' extra is not installed")
    from numa_engram.metrics import EngramCollector

    with SharedPLETable.create(SPEC, LAYER, etp_rank=1, etp_size=2, checkpoint=ckpt,
                               mode="independent", placement="node:0") as table:
        ids = np.zeros((10, SPEC.n_heads), np.int64)
        table.lookup(ids)
        table.lookup_packed(ids[:3])
        with pytest.raises(LookupIdError):
            table.lookup([SPEC.rows(LAYER)])
        assert table.placement_report().fraction_on_plan == 1.0
        stats = table.stats()
        assert (stats.lookups, stats.rows, stats.bad_id_lookups) == (2, 13 * 16, 1)
        assert stats.bytes_read == 13 * 16 * SPEC.row_bytes and stats.lookup_seconds > 0
        assert stats.physical_bytes == table.backing_bytes
        registry = prometheus_client.CollectorRegistry()
        registry.register(EngramCollector(tables=[table]))
        text = prometheus_client.generate_latest(registry).decode()
        key = f'heads="0-15",layer="{LAYER}",mode="independent"'
        for line in (f"numa_engram_lookups_total{{{key}}} 2.0",
                     f"numa_engram_bad_id_lookups_total{{{key}}} 1.0",
                     f"numa_engram_placement_on_plan_ratio{{{key}}} 1.0",
                     f"numa_engram_table_ready{{{key}}} 1.0"):
            assert line in text, text
    text = prometheus_client.generate_latest(registry).decode()
    assert f"numa_engram_table_ready{{{key}}} 0.0" in text


def test_large_lookups_split_over_the_nodes_threads_bit_exact_and_the_first_bad_id_named(ckpt):
    """A table of 3 lookup threads runs a large call on 2 workers and the
    caller (shared with the node's other tables): rows equal the one-thread
    call and vLLM's rule; a bad id in any part is named by its first
    position; the last table to close stops the workers."""
    from numa_engram.bindings import native

    from .test_lookup import _threads

    before = _threads()
    weight, scale = ple_scenarios.whole_table(ckpt, SPEC, LAYER)
    ids = np.random.default_rng(3).integers(0, SPEC.rows(LAYER), size=(700, SPEC.n_heads))
    with SharedPLETable.create(SPEC, LAYER, checkpoint=ckpt, mode="independent",
                               lookup_threads=3) as table, \
            SharedPLETable.create(SPEC, 2, checkpoint=ckpt, mode="independent",
                                  lookup_threads=3) as other:
        assert table._workers is other._workers
        assert _threads(settle_at=before + 2) == before + 2  # the loaders gone: 2 workers
        got = table.lookup(ids).view(torch.int16).numpy().view(np.uint16)
        alone = PLERowsAlone(table).rows_bf16(ids)
        assert np.array_equal(got, alone)
        assert np.array_equal(np.where(got == 0x7FC0, 0x7FC0, got),
                              ple_scenarios.vllm_rows(weight, scale, ids))
        assert np.array_equal(table.lookup_packed(ids), PLERowsAlone(table).rows_packed(ids))
        for where in (11_000, 20, 11_199):  # the last part, the first, the call's last id
            bad = ids.copy()
            bad.reshape(-1)[where] = -1
            bad.reshape(-1)[11_100] = SPEC.rows(LAYER)
            first = min(where, 11_100)
            with pytest.raises(LookupIdError, match=rf"\(position {first}\)"):
                table.lookup(bad)
        assert ids.size >= native.lib.NE_SPLIT_ROWS * 3  # the call did split
    assert _threads(settle_at=before) == before


def PLERowsAlone(table):  # noqa: N802 (reads as the class it makes)
    """The table's rows looked up by the caller alone."""
    from numa_engram.lookup.ple import PLERows

    return PLERows(table.weights, dtype=SPEC.dtype, row_start=table.shard.row_start,
                   total_rows=SPEC.rows(table.layer_id), scale=table.scale)


@pytest.mark.parametrize("tier", ["resident", "mapped"])
def test_every_lookup_path_is_bit_exact_with_numpys_rows(ckpt, tier):
    """lookup(ids) (a pooled tensor), lookup(ids, out=tensor) and
    lookup(ids, out=prepare_out(tensor)) of 0-d, 1, 8, 40 and 64 tokens,
    an ETP shard's (zeros for the other's rows) on the resident and the
    mapped tier, equal ``reference_rows`` over the checkpoint's bytes
    (atol 0); a result still held is not the next call's buffer."""
    from numa_engram.lookup.ple import reference_rows

    weight, scale = ple_scenarios.whole_table(ckpt, SPEC, LAYER)
    whole = weight.view(torch.uint8).numpy()
    rng = np.random.default_rng(5)
    with SharedPLETable.create(SPEC, LAYER, checkpoint=ckpt, mode="independent", etp_rank=1,
                               etp_size=2, tier=tier) as table:
        start, end = table.shard.row_start, table.shard.row_end
        shard = whole[start:end]
        for shape in [(), (1, SPEC.n_heads), (8, SPEC.n_heads), (40, SPEC.n_heads),
                      (64, SPEC.n_heads)]:
            ids = rng.integers(0, SPEC.rows(LAYER), size=shape)
            want = reference_rows(shard, ids, row_start=start, scale=table.scale)
            held = table.lookup(ids)
            again = table.lookup(rng.integers(0, SPEC.rows(LAYER), size=shape))
            assert again.data_ptr() != held.data_ptr()  # held: not reused
            out = torch.empty((*shape, SPEC.head_dim), dtype=torch.bfloat16)
            prepared = table.prepare_out(torch.empty_like(out))
            for got in (held, table.lookup(ids, out), table.lookup(ids, prepared)):
                assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16), want)
            assert np.array_equal(table.lookup_packed(ids), np.where(
                ((ids >= start) & (ids < end))[..., None], whole[ids], 0))
        stats = table.stats()  # five lookups of each shape, counted with their ids
        assert (stats.lookups, stats.rows) == (5 * 5, 5 * (1 + SPEC.n_heads * (1 + 8 + 40 + 64)))


def test_a_prepared_out_keeps_every_check_of_a_callers_out(ckpt):
    """prepare_out: out over the table's mapping refused when prepared, ids
    sharing its bytes refused at the call (the ids left as they were), a
    lookup of another shape refused naming both; a closed table refuses
    the call."""
    from numa_engram.errors import SpecError

    ids = np.arange(4 * SPEC.n_heads, dtype=np.int64).reshape(4, SPEC.n_heads)
    with SharedPLETable.create(SPEC, LAYER, checkpoint=ckpt, mode="independent") as table:
        with warnings.catch_warnings():  # (the sealed rows' read-only view: never written)
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.from_numpy(table.weights[:8 * SPEC.n_heads])
        over_table = rows.view(-1).view(torch.bfloat16).view(4, SPEC.n_heads, SPEC.head_dim)
        with pytest.raises(SpecError, match="out and the table's mapping share bytes"):
            table.prepare_out(over_table)
        whole = torch.zeros(4 * SPEC.n_heads * SPEC.head_dim, dtype=torch.bfloat16)
        prepared = table.prepare_out(whole.view(4, SPEC.n_heads, SPEC.head_dim))
        shared = whole.view(torch.int64)[:ids.size].numpy().reshape(ids.shape)
        shared[:] = ids
        with pytest.raises(SpecError, match="out and the ids share bytes"):
            table.lookup(shared, prepared)
        assert np.array_equal(shared, ids)
        with pytest.raises(SpecError, match=r"prepared out= of \[4, 16, 10\].*\[2, 16, 10\]"):
            table.lookup(ids[:2], prepared)
        assert table.lookup(ids, prepared) is prepared.result
    with pytest.raises(StorageError, match="closed"):
        table.lookup(ids, prepared)


def test_a_closed_tables_rows_are_refused_by_the_kernel(ckpt):
    """The kernel counts a table's lookups and refuses them once close()
    ran (it waits for running ones before unmapping): rows held past close
    (a thread's that passed the open check) raise StorageError instead of
    reading the unmapped rows (a SIGSEGV)."""
    ids = np.arange(2 * SPEC.n_heads).reshape(2, SPEC.n_heads)
    with SharedPLETable.create(SPEC, LAYER, checkpoint=ckpt, mode="independent") as table:
        rows = table.rows
        table.lookup(ids)
        table.lookup_packed(ids)
        assert (table.stats().lookups, table.stats().rows) == (2, 2 * ids.size)
    for look in (rows.lookup, rows.rows_bf16, rows.rows_packed):
        with pytest.raises(StorageError, match="closed"):
            look(ids)
