"""`numa-engram plan` for DeepSeek V4.1 Flash (from its config.json) on
2-socket hosts of 8 GPUs, TP 2 x DP 4: each policy's numbers against hand
arithmetic, the gpu-local fallback explained, a host too small refused
with the commands that fix it."""

import json
import subprocess
import sys

import pytest

ROWS = {1: 384006168, 14: 384016682}   # engram_num_embeddings of V4.1 Flash
ROW_BYTES = 256 + 256 // 32             # FP8 row + one ue8m0 scale per 32 values
TOTAL = sum(ROWS.values()) * ROW_BYTES
GIB = 2**30


def flash_config(path):
    text = {"engram_layer_ids": [1, 14], "engram_num_embeddings": list(ROWS.values()),
            "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8,
            "engram_head_dim": 256, "engram_compressed_vocab_size": 99092,
            "engram_pad_token_id": 2}
    path.write_text(json.dumps({"model_type": "deepseek_v4", "architectures": ["X"],
                                "image_token_id": 129264, "text_config": text}))
    return str(path)


def plan(*args, code=0):
    out = subprocess.run([sys.executable, "-m", "numa_engram", "plan", "--json", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == code, (out.returncode, out.stderr)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return flash_config(tmp_path_factory.mktemp("flash") / "config.json")


def _tp_shard_bytes(config):
    """Each TP rank's bytes: its 12 heads' primes (the spec's; their sums
    are checked against engram_num_embeddings by from_config)."""
    import numpy as np

    from numa_engram import EngramSpec

    with open(config) as fh:
        doc = json.load(fh)["text_config"]
    spec = EngramSpec.from_config(doc, (np.arange(99092), 99092))
    assert [spec.rows(layer) for layer in (1, 14)] == list(ROWS.values())
    return [sum(sum(spec.bucket_sizes(layer)[12 * r:12 * r + 12]) for layer in (1, 14))
            * ROW_BYTES for r in range(2)]


@pytest.mark.slow  # starts an interpreter (~1 s)
def test_each_policy_against_hand_arithmetic(config):
    base = ["--spec", config, "--simulate", "2x4", "--tp", "2", "--dp", "4"]
    shards = _tp_shard_bytes(config)
    assert sum(shards) == TOTAL and abs(TOTAL / GIB - 188.83) < 0.01

    local = plan(*base, "--policy", "gpu-local")
    assert local["bytes_per_node"] == {"0": TOTAL, "1": 0} and local["copies"] == 1.0
    assert local["remote_fraction"] == 0.5  # every sharing group spans both sockets
    assert any("gpu-local falls back" in n and "nodes 0-1" in n for n in local["notes"])
    # a dp_shared rank maps its TP shard: 8 bytes per 4 KiB page, 8 ranks per host
    tables = local["page_tables"]["4K"]
    assert tables["per_process"] == -(-max(shards) // 4096) * 8  # ~188.8 MiB
    assert tables["per_host"] == 4 * sum(-(-s // 4096) * 8 for s in shards)  # ~1.48 GiB
    assert local["page_tables"]["2M"]["per_process"] == -(-max(shards) // (2 << 20)) * 8

    inter = plan(*base, "--policy", "interleave")
    assert abs(inter["bytes_per_node"]["0"] - TOTAL / 2) < 4 * 2**20
    assert inter["remote_fraction"] == 0.5 and inter["copies"] == 1.0

    rep = plan(*base, "--policy", "replicate-per-node")
    assert rep["bytes_per_node"] == {"0": TOTAL, "1": TOTAL} and rep["copies"] == 2.0
    assert rep["remote_fraction"] == 0.0 and rep["host_bytes"] == 2 * TOTAL  # 377.67 GiB
    assert rep["mode_memory"]["dp_shared"]["0"] == 2 * TOTAL  # the second copy counted

    sharded = plan(*base, "--mode", "dp_sharded", "--policy", "gpu-local")
    assert sharded["remote_fraction"] == 0.0 and sharded["copies"] == 1.0
    assert abs(sharded["bytes_per_node"]["0"] - TOTAL / 2) < 0.01 * TOTAL
    slice_table = sharded["page_tables"]["4K"]["per_process"]
    assert abs(slice_table / 2**20 - 47.2) < 0.5  # a quarter of a TP shard per rank

    first_touch = plan(*base, "--policy", "none")
    assert first_touch["remote_fraction"] is None and any("first touch" in n
                                                          for n in first_touch["notes"])
    assert "dp_sharded --policy gpu-local" in local["recommendation"]


def test_a_host_too_small_is_refused_with_the_commands_that_fix_it(config, tmp_path):
    host = tmp_path / "host.json"
    host.write_text(json.dumps({"nodes": [{"id": n, "cpus": [n], "mem_total": 128 * GIB,
                                           "distances": [10, 21] if n == 0 else [21, 10]}
                                          for n in (0, 1)],
                                "gpus": [{"index": g, "numa_node": g // 4} for g in range(8)]}))
    doc = plan("--spec", config, "--simulate", str(host), "--tp", "2", "--dp", "4",
               "--page-size", "2M", code=1)
    assert not doc["fits"] and doc["shortfalls"] == ["node 0 needs 188.83 GiB of its 128.00 GiB"]
    pages = -(-TOTAL // (2 << 20))
    assert (f"echo {pages} > /sys/devices/system/node/node0/hugepages/hugepages-2048kB/"
            "nr_hugepages") in "\n".join(doc["fixes"])
    fits = plan("--spec", config, "--simulate", str(host), "--tp", "2", "--dp", "4",
                "--mode", "dp_sharded")
    assert fits["fits"]  # each socket holds its half


def test_lost_sharing_and_gpu_less_hosts_are_said(config):
    lost = plan("--spec", config, "--simulate", "2x4", "--tp", "3", "--dp", "4")
    assert any("sharing lost: TP 3 does not divide the 8 GPUs" in n for n in lost["notes"])
    assert lost["mode_memory"]["dp_shared"] == lost["mode_memory"]["independent"]
    alone = plan("--spec", config, "--simulate", "2x0", "--tp", "2", "--dp", "2")
    assert list(alone["mode_memory"]["dp_shared"]) == ["0"]  # one host of 4 ranks, shared
    assert alone["mode_memory"]["dp_shared"]["0"] == TOTAL


def test_registration_time_per_page_size_is_given_or_said_unmeasured(config):
    doc = plan("--spec", config, "--simulate", "2x4", "--register-s-per-gb", "4K=0.1,2M=0.01")
    shard = max(doc["mapped_per_process"].values())
    assert doc["register_seconds_per_process"]["4K"] == pytest.approx(shard / 1e9 * 0.1)
    assert doc["register_seconds_per_process"]["2M"] == pytest.approx(shard / 1e9 * 0.01)
    assert doc["register_seconds_per_process"]["1G"] is None  # not measured: not invented


def test_a_small_model_at_tp2_dp4_plans_dp_shared_and_says_why_dp_sharded_is_out(tmp_path):
    """4 hash heads cannot be cut into 8 DP-sharded slices: the dp_shared
    plan asked for is made, the comparison column nobody asked for is
    left out with the reason."""
    import contextlib
    import io
    import json

    from numa_engram import EngramSpec, write_synthetic_model
    from numa_engram.cli.app import main

    model = write_synthetic_model(tmp_path / "m", EngramSpec.small(
        rows_per_head=100, n_head_per_ngram=2, head_dim=64, max_ngram_size=3))
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(["plan", "--json", "--model", str(model), "--tp", "2", "--dp", "4",
                     "--mode", "dp_shared", "--simulate", "2x4"])
    doc = json.loads(buffer.getvalue())
    assert code == 0
    assert any("dp_sharded is not an option here" in n for n in doc["notes"]), doc["notes"]
    assert "dp_sharded" not in doc["mode_memory"]


def test_a_qwen4_exp_model_plans_one_copy_per_tp_shard_beside_vllms_per_rank_cost(tmp_path):
    """A Qwen3.8-Flash-Next-class directory (one PLE layer of 320,001,536
    rows of 160 FP8 bytes, defaults otherwise) on 2 sockets, TP 2 x DP 8:
    dp_shared holds one copy of each TP shard on the host; vLLM's per-rank
    pinned tables are 16 shards; the notes say both."""
    from numa_engram.model.ple import PLESpec

    text = {"hidden_size": 2560, "num_hidden_layers": 4, "ple_layer_ids": [2],
            "ple_embed_dim": 2560, "vocab_size": 151_936, "eos_token_id": 151_645,
            "ple_embedding_dtype": "float8_e4m3fn"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen4_exp",
                                                      "text_config": text}))
    spec = PLESpec.from_config(tmp_path / "config.json")
    assert (spec.rows(2), spec.head_dim) == (320_001_536, 160)
    one_copy = spec.table_bytes() + 2 * 4  # two TP shards, each with its scale
    doc = plan("--model", str(tmp_path), "--simulate", "2x8", "--tp", "2", "--dp", "8",
               "--mode", "dp_shared")
    assert doc["host_bytes"] == one_copy and abs(doc["copies"] - 1.0) < 1e-6
    assert sum(doc["bytes_per_node"].values()) == one_copy
    per_rank = spec.shard_bytes(2, 2, 0)
    assert doc["mode_memory"]["independent"] == {"0": 16 * per_rank}
    assert any("vLLM 0.31.0 holds PLE tables per rank" in n and "381.47 GiB per host" in n
               for n in doc["notes"]), doc["notes"]
    sharded = plan("--model", str(tmp_path), "--simulate", "2x8", "--tp", "2", "--dp", "8",
                   "--mode", "dp_sharded")
    assert sharded["remote_fraction"] == 0.0 and sharded["host_bytes"] == spec.table_bytes() \
        + 16 * 4


# ----------------------------------------------------- tiers --
# Each mode: resident when its tables fit the memory budget, else mapped
# with the hit rate a row-access profile expects, else neither.

def _profile(path, table_bytes, curve):
    path.write_text(json.dumps({"format": "numa-engram-profile/1", "table_bytes": table_bytes,
                                "curve": curve}))
    return str(path)


def test_resident_fits_a_host_with_the_memory(config):
    doc = plan("--spec", config, "--simulate", "2x4", "--tp", "2", "--dp", "4")
    assert doc["memory"] == {"budget": 2 << 40, "source": "the simulated nodes' memory"}
    assert {t["mode"]: t["tier"] for t in doc["tiers"]} == {
        "independent": "resident", "dp_shared": "resident", "dp_sharded": "resident"}
    assert doc["fits"]


def test_a_budget_below_the_tables_gives_the_mapped_tier_and_its_hit_rate(config, tmp_path):
    curve = [[10 * GIB, 0.5], [80 * GIB, 0.9], [TOTAL, 1.0]]
    doc = plan("--spec", config, "--simulate", "2x4", "--memory-budget", "40G",
               "--profile", _profile(tmp_path / "p.json", TOTAL, curve), code=1)
    tiers = {t["mode"]: t for t in doc["tiers"]}
    assert tiers["dp_shared"]["tier"] == "mapped" and tiers["dp_shared"]["budget"] == 40 * GIB
    assert tiers["dp_shared"]["hit_rate"] == pytest.approx(0.5 + 0.4 * 30 / 70, abs=1e-9)
    assert tiers["independent"]["resident_bytes"] == 4 * TOTAL  # a copy per replica
    assert doc["shortfalls"] == ["188.83 GiB of dp_shared tables per host do not fit the memory "
                                 "budget, 40.00 GiB (--memory-budget)"]
    assert any("tier='mapped'" in f and "67.1% of page reads" in f for f in doc["fixes"])
    # a profile of a table half the size: the same fraction of it
    half = plan("--spec", config, "--simulate", "2x4", "--memory-budget", "40G",
                "--profile", _profile(tmp_path / "h.json", TOTAL // 2, curve), code=1)
    rate = {t["mode"]: t for t in half["tiers"]}["dp_shared"]["hit_rate"]
    assert rate == pytest.approx(0.5 + 0.4 * (20 - 10) / 70, rel=1e-3)  # 40G of it is 20G
    # no profile: mapped, the hit rate unknown and said so
    blind = plan("--spec", config, "--simulate", "2x4", "--memory-budget", "40G", code=1)
    assert {t["mode"]: t for t in blind["tiers"]}["dp_shared"]["hit_rate"] is None
    assert any("pass --profile" in f for f in blind["fixes"])


def test_a_budget_below_one_steps_pages_is_neither(config):
    # 256 tokens x 24 heads x 2 layers x 2 pages (weights, scales) = 96 MiB
    doc = plan("--spec", config, "--simulate", "2x4", "--memory-budget", "64M", code=1)
    assert {t["tier"] for t in doc["tiers"]} == {"neither"}
    assert "less than one step's pages (96.00 MiB at 256 tokens)" in doc["tiers"][0]["why"]
    assert plan("--spec", config, "--simulate", "2x4", "--memory-budget", "64M", "--batch", "64",
                code=1)["tiers"][1]["tier"] == "mapped"  # 24 MiB a step


def test_a_malformed_profile_is_refused_by_name(config, tmp_path):
    bad = _profile(tmp_path / "bad.json", TOTAL, [[2 * GIB, 0.9], [GIB, 0.95]])
    out = subprocess.run([sys.executable, "-m", "numa_engram", "plan", "--spec", config,
                          "--simulate", "2x4", "--memory-budget", "40G", "--profile", bad],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "bad.json: its table_bytes or curve is malformed" in out.stderr


def test_the_hosts_budget_is_the_smaller_of_memavailable_and_the_cgroup_limit(tmp_path):
    """host_memory over a directory laid out like /proc: v1 and v2 cgroups,
    each mounted where mountinfo says, the tighter limit taken."""
    from numa_engram.host.accounting import host_memory

    proc, v1, v2 = tmp_path / "proc", tmp_path / "memcg", tmp_path / "unified"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\n")
    (proc / "self" / "cgroup").write_text("5:memory:/job\n0::/job2\n")
    (proc / "self" / "mountinfo").write_text(
        f"30 20 0:26 / {v1} rw - cgroup cgroup rw,memory\n"
        f"31 20 0:27 / {v2} rw - cgroup2 cgroup2 rw\n")
    for d, name, usage, limit in ((v1 / "job", "limit_in_bytes", "usage_in_bytes", 3 * GIB),
                                  (v2 / "job2", "max", "current", 5 * GIB)):
        d.mkdir(parents=True)
        (d / f"memory.{name}").write_text(f"{limit}\n")
        (d / f"memory.{usage}").write_text(f"{GIB}\n")
    host = host_memory(str(proc), str(tmp_path))
    assert host.available == 4 * GIB and host.cgroup.limit == 3 * GIB
    assert host.cgroup.path == str(v1 / "job") and host.budget == 3 * GIB
    (v1 / "job" / "memory.limit_in_bytes").write_text(f"{1 << 62}\n")  # no v1 limit
    assert host_memory(str(proc), str(tmp_path)).budget == 4 * GIB  # MemAvailable now
    assert host_memory(str(proc), str(tmp_path)).shm_total > 0  # tmp_path's file system
