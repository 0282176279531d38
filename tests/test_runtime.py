"""EngramRuntime: a model directory as DeepSeek ships one, served step by
step, every layer's rows bit-exact with a single-process reference; the
V4.1 config as shipped; look-back windows as a runner supplies them."""

import json
from pathlib import Path

import numpy as np
import pytest

from numa_engram import (
    EngramRuntime,
    EngramSpec,
    HashState,
    ModelDirectory,
    SharedEngramTable,
    shard_heads,
    write_synthetic_model,
)
from numa_engram.errors import (
    CheckpointError,
    PrefetchError,
    SpecError,
    SpecMismatchError,
    TopologyError,
)
from numa_engram.runtime.tpgather import window

from .support.runtime_plan import reference_rows, replica_plan, same_bits, v41_hashes

pytest.importorskip("tokenizers", reason="the 'tokenizers' extra is not installed")

# 5 heads x 3 orders = 15 columns: TP 2 gives 8 + 7 (a padded head), TP 2 x EDP 2 4 shards
SPEC = EngramSpec.small(rows_per_head=150, n_head_per_ngram=5, head_dim=64, max_ngram_size=4,
                        compressed_vocab_size=120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_synthetic_model(tmp_path_factory.mktemp("model"), SPEC, shards=3))


# ---------------------------------------------------------- V4.1 config --

def flash_config(pad_field="engram_pad_token_id", **changes):
    """V4.1 Flash's text_config as it ships (the Engram fields)."""
    text = {"engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
            "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8,
            "engram_head_dim": 256, "engram_compressed_vocab_size": 99092, pad_field: 2}
    text.update(changes)
    return {"model_type": "deepseek_v4", "image_token_id": 129264, "text_config": text}


@pytest.mark.parametrize("pad_field", ["engram_pad_token_id", "engram_pad_id"])
def test_v41_flash_config_as_shipped_builds_the_table_it_names(pad_field):
    token_map = (np.arange(99092), 99092)
    spec = EngramSpec.from_config(flash_config(pad_field), token_map)
    assert [spec.rows(layer) for layer in spec.layer_ids] == [384006168, 384016682]
    assert spec.pad_id == 2 and spec.n_hash_cols == 24 and spec.head_dim == 256


def test_a_wrong_vocab_or_row_count_names_both_numbers():
    token_map = (np.arange(99092), 99092)
    with pytest.raises(SpecMismatchError, match="token map has 99092 compressed ids, the "
                                                "config's engram_compressed_vocab_size is 99093"):
        EngramSpec.from_config(flash_config(engram_compressed_vocab_size=99093), token_map)
    with pytest.raises(SpecMismatchError, match="layer 14: engram_num_embeddings is 384016681 "
                                                "but its primes sum to 384016682"):
        EngramSpec.from_config(flash_config(engram_num_embeddings=[384006168, 384016681]),
                               token_map)


# ------------------------------------------------------- model directory --

def test_a_synthetic_model_directory_reads_back_as_its_spec(model_dir):
    model = ModelDirectory.open(model_dir)
    assert model.spec == SPEC
    assert model.dead_ids == (SPEC.compressed_vocab_size - 1,)  # the image placeholder
    assert len(model.token_map) > SPEC.compressed_vocab_size  # aliases share ids
    assert int(model.token_map.max()) + 1 == SPEC.compressed_vocab_size
    doc = json.loads(Path(model_dir, "config.json").read_text())
    assert "engram_pad_token_id" in doc["text_config"] and "image_token_id" in doc
    index = json.loads(Path(model_dir, "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert "layers.14.engram.embed.scale" in index["weight_map"]


def test_a_directory_without_config_or_tokenizer_is_refused_by_name(tmp_path, model_dir):
    with pytest.raises(CheckpointError, match="has no config.json"):
        ModelDirectory.open(tmp_path)
    (tmp_path / "config.json").write_text(Path(model_dir, "config.json").read_text())
    with pytest.raises(SpecError, match="has no tokenizer.json and the config no "
                                        "engram_token_map"):
        ModelDirectory.open(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        ModelDirectory.open(tmp_path / "nothing")
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {}}))
    with pytest.raises(SpecError, match="no engram_layer_ids"):
        ModelDirectory.open(tmp_path)


def test_write_synthetic_model_refuses_what_a_config_cannot_carry(tmp_path):
    with pytest.raises(SpecError, match="seed 0 and block 32, the spec has seed 3"):
        write_synthetic_model(tmp_path, EngramSpec.small(seed=3))


# ------------------------------------------------------------ one rank --

def _reference_tables(spec, model_dir):
    return {layer: SharedEngramTable.create(spec, layer, shard_heads(
        spec.bucket_sizes(layer), 1, 0), checkpoint=model_dir, mode="independent")
        for layer in spec.layer_ids}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_one_rank_serves_a_stream_bit_exact(model_dir, sequence_parallel):
    """TP 1: prefill chunks, decode steps, image spans, speculative tokens
    and a restored request, in random slot orders; each layer's rows equal
    the whole-sequence reference (with SP at TP 1 the window is every token)."""
    with EngramRuntime.from_pretrained(model_dir, max_tokens=64, max_requests=6,
                                       sequence_parallel=sequence_parallel) as rt:
        reference = _reference_tables(rt.spec, model_dir)
        image = rt.model.dead_ids[0]
        plan = replica_plan(7, 10, len(rt.model.token_map), image)
        assert any(s.restores for s in plan) and any(not all(s.commit) for s in plan)
        assert any(image in s.ids for s in plan)
        for step in plan:
            for slot in step.releases:
                rt.release(slot)
            for slot, position, prefix in step.restores:
                rt.restore(slot, position, prefix)
            rt.begin_step(step.ids, step.slots, step.positions, commit=step.commit_array())
            for layer in rt.layer_ids:
                got = rt.embed(layer)
                assert same_bits(got, reference_rows(rt.model, reference, step, layer))
        report, stats = rt.mode_report(), rt.stats()
        for table in reference.values():
            table.close()
    assert report["tp_size"] == 1 and report["embedding_dp_size"] == 1
    assert {"read", "checks", "create", "populate", "map", "load"} <= set(report["startup_s"])
    assert stats["steps"] == 10 and stats["tokens"] == sum(len(s.ids) for s in plan)
    assert all(v["prefetch"]["lookups"] == 10 for v in stats["layers"].values())


def test_two_threads_on_one_runtime_never_get_each_others_rows(model_dir):
    """A step is its thread's until embedded: another thread's begin_step,
    prepare or embed meanwhile (or any call during a call) is a
    PrefetchError naming the rule; every rows a thread does get are its own
    step's, bit-exact, with threads switching between any two bytecodes."""
    import random
    import sys
    import threading
    import time

    with EngramRuntime.from_pretrained(model_dir, max_tokens=16, max_requests=4) as rt:
        reference = _reference_tables(rt.spec, model_dir)
        rt.begin_step([3, 4], [0, 0], [0, 1])  # directed: this thread's step is pending
        other = []
        worker = threading.Thread(target=lambda: other.append(_refused(
            lambda: rt.begin_step([5], [1], [0]))))
        worker.start()
        worker.join()
        assert other == ["a step begun by thread"]
        for layer in rt.layer_ids:
            rt.embed(layer)
        wrong, refused, done = [], [], []

        def drive(slot, tokens):
            # until both outcomes were seen (at least 150 tries): how the two
            # threads interleave is the scheduler's, and under a tracer
            # (coverage) most tries can collide.  A refused thread backs off a
            # random while, as a caller would: with none, on a loaded host the
            # two can fall into a lockstep where every try of both collides
            # and no step is ever done
            backoff = random.Random(slot)
            for n in range(5000):
                if n >= 150 and done and refused:
                    break
                try:
                    ids = rt.begin_step(tokens, [slot] * len(tokens), list(range(len(tokens))),
                                        commit=False)
                    step = rt._steps  # this thread's until its last embed returns
                    for i, layer in enumerate(rt.layer_ids):
                        got = rt.embed(layer).clone()
                        # the last embed ends the step: the other thread's next
                        # step may overwrite that buffer before the clone, as
                        # embed's contract says; checked when no step began
                        if layer == rt.layer_ids[-1] and rt._steps != step:
                            continue
                        want = reference[layer].lookup(ids[:, i], id_format="global")
                        if not same_bits(got, want):
                            wrong.append((slot, n, layer))
                    done.append(slot)
                except PrefetchError as exc:
                    refused.append(str(exc))
                    time.sleep(backoff.uniform(0, 2e-4))
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            threads = [threading.Thread(target=drive, args=(slot, toks))
                       for slot, toks in ((1, [7, 8, 9]), (2, [10, 11, 12, 13]))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(old)
        for table in reference.values():
            table.close()
    assert wrong == []
    assert done and refused, (len(done), len(refused))
    assert all("one thread drives a step" in m for m in refused)


def test_release_and_restore_after_close_say_the_runtime_is_closed(model_dir):
    rt = EngramRuntime.from_pretrained(model_dir, max_tokens=8, max_requests=2)
    rt.close()
    with pytest.raises(PrefetchError, match="the Engram runtime is closed"):
        rt.release(0)
    with pytest.raises(PrefetchError, match="the Engram runtime is closed"):
        rt.restore(0, 2, [3, 4])


def _refused(call):
    try:
        call()
    except PrefetchError as exc:
        return str(exc)[:22]
    return "accepted"


def test_prepare_takes_hash_ids_computed_elsewhere(model_dir):
    """A stack that hashes itself (vLLM's kernel: int32 global rows for all
    layers) submits them with prepare; the rows match begin_step's."""
    with EngramRuntime.from_pretrained(model_dir, max_tokens=16, max_requests=2) as rt:
        ids, slots, positions = [3, 4, 5, 6], [0, 0, 1, 1], [0, 1, 0, 1]
        hashed = rt.begin_step(ids, slots, positions)
        first = {layer: rt.embed(layer).clone() for layer in rt.layer_ids}
        for layer in rt.layer_ids:
            rt.prepare(layer, hashed.astype(np.int32))
        for layer in rt.layer_ids:
            assert same_bits(rt.embed(layer), first[layer])
        with pytest.raises(SpecError, match=r"pass \[T, 15\]"):
            rt.prepare(1, hashed[:, :, :3])


def test_misuse_is_refused_by_name(model_dir):
    with EngramRuntime.from_pretrained(model_dir, max_tokens=4, max_requests=2) as rt:
        with pytest.raises(PrefetchError, match=r"embed\(1\) without begin_step"):
            rt.embed(1)
        with pytest.raises(SpecError, match="5 tokens in one step exceed max_tokens 4"):
            rt.begin_step([1] * 5, [0] * 5, list(range(5)))
        with pytest.raises(SpecError, match=r"layer 2 has no Engram table.*\[1, 14\]"):
            rt.embed(2)
        rt.begin_step([1], [0], [0])
        rt.begin_step([2], [0], [1])  # the last step's lookups were never embedded: dropped
        assert rt.embed(14).shape == (1, 15, 64)
    with pytest.raises(PrefetchError, match="closed"):
        rt.begin_step([1], [0], [0])
    with pytest.raises(SpecError, match="sharing must be one of"):
        EngramRuntime.from_pretrained(model_dir, sharing="shared")
    with pytest.raises(TopologyError, match="host tensors"):
        EngramRuntime.from_pretrained(model_dir, sharing="dp_sharded", device=0)


def _gpu_or_why() -> str | None:
    import torch

    from numa_engram.bindings import cudart

    ok, why = cudart.available()
    if ok and not torch.cuda.is_available():
        return "the CUDA runtime loads but this torch build has no CUDA"
    return None if ok else f"no usable GPU: {why}"


@pytest.mark.gpu
def test_the_runtime_on_a_gpu_gives_the_cpu_runtimes_rows(model_dir):
    """device=0: tables registered, lookups on the CUDA prefetch stream;
    the rows equal the CPU runtime's bit for bit."""
    why = _gpu_or_why()
    if why:
        pytest.skip(why)
    cpu = EngramRuntime.from_pretrained(model_dir, max_tokens=64, max_requests=6)
    gpu = EngramRuntime.from_pretrained(model_dir, max_tokens=64, max_requests=6, device=0)
    with cpu, gpu:
        for step in replica_plan(11, 6, len(cpu.model.token_map), cpu.model.dead_ids[0]):
            for rt in (cpu, gpu):
                for slot in step.releases:
                    rt.release(slot)
                for slot, position, prefix in step.restores:
                    rt.restore(slot, position, prefix)
                rt.begin_step(step.ids, step.slots, step.positions,
                              commit=step.commit_array())
            for layer in cpu.layer_ids:
                on_gpu = gpu.embed(layer)
                assert on_gpu.is_cuda and same_bits(on_gpu.cpu(), cpu.embed(layer))
        assert gpu.mode_report()["layers"][1]["registered_device"] == 0


def test_sequence_hashes_cut_at_dead_tokens_as_the_per_token_rule_does():
    from numa_engram.model.hashing import sequence_hashes

    rng = np.random.default_rng(3)
    for _ in range(20):
        seq = [int(x) for x in rng.integers(0, 100, 14)]
        for i in rng.integers(0, 14, int(rng.integers(0, 4))):
            seq[i] = -1
        for layer in SPEC.layer_ids:
            np.testing.assert_array_equal(sequence_hashes(SPEC, seq, layer),
                                          v41_hashes(SPEC, seq, layer))


def test_sp_windows_cover_every_token_once_then_zeros():
    """ceil(T/tp) tokens a rank; a window past the last token holds none."""
    assert [window(5, 2, r) for r in range(2)] == [(0, 3, 3), (3, 3, 2)]
    assert [window(2, 4, r) for r in range(4)] == [(0, 1, 1), (1, 1, 1), (2, 1, 0), (3, 1, 0)]
    assert window(0, 2, 1) == (0, 0, 0)


# ------------------------------------------------- look-back windows --

def test_an_unknown_lookback_id_hashes_as_pad_and_is_not_dead():
    """vLLM's runner writes -1 where it does not know a look-back id: that
    id hashes as the pad id and older ids are still read; a DEAD id (mask
    False) stops the look-back there."""
    spec = EngramSpec.small(rows_per_head=97, n_head_per_ngram=2, max_ngram_size=4)
    seq = [11, 12, 13, 14]
    state = HashState(spec, max_requests=3)
    state.restore(0, 3, [11, -1, 13], unknown_id=-1)   # position 1 unknown
    state.restore(1, 3, [11, 12, 13], prefix_mask=[True, False, True])  # position 1 DEAD
    state.restore(2, 3, [99, 98, 11, -1, 13], unknown_id=-1)  # a longer window: last 3 count
    got = state.hash([14, 14, 14], [0, 1, 2], [3, 3, 3])[:, 0]
    layer = spec.layer_ids[0]
    unknown = v41_hashes(spec, [11, spec.pad_id, 13, 14], layer)[-1]
    dead = v41_hashes(spec, [11, -1, 13, 14], layer)[-1]
    np.testing.assert_array_equal(got[0], unknown)
    np.testing.assert_array_equal(got[1], dead)
    np.testing.assert_array_equal(got[2], unknown)
    assert not np.array_equal(unknown, dead)  # the 4-gram reads id 11 only when unknown
    assert not np.array_equal(unknown, v41_hashes(spec, seq, layer)[-1])
    # without unknown_id a negative id is DEAD, as in hash()
    state.restore(0, 3, [11, -1, 13])
    np.testing.assert_array_equal(state.hash([14], [0], [3])[0, 0], dead)


# ------------------------------------------------- TP 2 x DP 2, 4 ranks --

def _serve_world(model_dir, **kwargs):
    from .support import runtime_scenarios as scenarios
    from .support.dist_harness import run_world

    results = run_world(4, scenarios.serve, timeout_s=240, model_dir=model_dir, tp=2, **kwargs)
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["mismatches"] == [], r["mismatches"]
    return results


def _check_stream_kinds(results):
    """The plan really mixed what the test says it mixes."""
    assert all(r["steps"] == 9 for r in results)
    assert sum(r["restores"] for r in results) and sum(r["speculative"] for r in results)
    assert sum(r["images"] for r in results) and sum(r["idle_steps"] for r in results)


@pytest.mark.multiproc
def test_tp2_dp2_shared_tables_give_every_rank_vllm_rows(model_dir):
    """Every rank's embed equals the reference's [T, 15 heads, 64]; the
    tables are shared by the DP peers of a TP rank (groups measured)."""
    results = _serve_world(model_dir, sharing="dp_shared")
    _check_stream_kinds(results)
    for r in results:
        assert r["mode"] == "dp_shared" and r["embedding_dp_size"] == 1
        assert r["sharing_group"] == [r["rank"] % 2, r["rank"] % 2 + 2]
        assert r["heads"] == {"1": [0, 8] if r["rank"] % 2 == 0 else [8, 15],
                              "14": [0, 8] if r["rank"] % 2 == 0 else [8, 15]}


@pytest.mark.multiproc
def test_tp2_dp2_sequence_parallel_ranks_get_their_windows(model_dir):
    """With SP each rank keeps ceil(T/2) tokens with all 15 heads (zeros
    past the last token), as vLLM's row select does."""
    _check_stream_kinds(_serve_world(model_dir, sharing="auto", sequence_parallel=True))


@pytest.mark.multiproc
def test_tp2_dp2_through_vllm_style_group_coordinators(model_dir):
    """tp_group and edp_group given as GroupCoordinator-like objects
    (rank_in_group, world_size, cpu_group, device_group, ranks): the same
    rows, the EDP group limiting the sharing group."""
    results = _serve_world(model_dir, sharing="dp_shared", give_edp=True, as_coordinators=True)
    assert all(r["sharing_group"] == [r["rank"] % 2, r["rank"] % 2 + 2] for r in results)


@pytest.mark.multiproc
@pytest.mark.parametrize("give_counts", [False, True])
def test_tp2_dp2_dp_sharded_exchange_completes_the_heads(model_dir, give_counts):
    """Each of the 4 ranks holds a quarter of the heads; the EDP exchange
    and the TP gather give every rank all 15 (counts given: one collective
    fewer per layer)."""
    results = _serve_world(model_dir, sharing="dp_sharded", give_edp=True,
                           give_counts=give_counts)
    for r in results:
        assert r["mode"] == "dp_sharded" and r["embedding_dp_size"] == 2
        assert r["edp_group"] == [r["rank"] % 2, r["rank"] % 2 + 2]


@pytest.mark.multiproc
def test_tp_ranks_that_disagree_on_order_or_token_count_all_fail_naming_each_rank(model_dir):
    """Layers embedded in different orders, then steps of 3 and 4 tokens:
    every rank raises the same TopologyError (no wrong rows, no SIGABRT in
    gloo), and the next step they agree on gives the reference's rows."""
    from .support import runtime_scenarios as scenarios
    from .support.dist_harness import run_world

    results = run_world(2, scenarios.disagree, timeout_s=240, model_dir=model_dir)
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["agreed"]
        order, count = r["raised"]["order"], r["raised"]["count"]
        assert all(e and e.startswith("TopologyError: the TP ranks disagree") for e in order)
        assert "rank 0 embeds layer 1 with 3 tokens, rank 1 embeds layer 14 with 3" in order[0]
        assert count.startswith("TopologyError") and \
            "rank 0 embeds layer 1 with 3 tokens, rank 1 embeds layer 1 with 4 tokens" in count
    assert results[0]["raised"] == results[1]["raised"]


def test_a_raw_model_directory_is_streamed_and_reads_back(tmp_path):
    """write_synthetic_model(raw=True): one safetensors file written in
    chunks without torch; the checkpoint resolves and loads."""
    import subprocess
    import sys

    code = ("import sys\nfrom numa_engram import EngramSpec, write_synthetic_model\n"
            f"write_synthetic_model({str(tmp_path)!r}, EngramSpec.small(rows_per_head=500), "
            "raw=True)\nassert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    model = ModelDirectory.open(tmp_path)
    spec = model.spec
    table = SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                     checkpoint=model.checkpoint, directory=None)
    with table:
        scales = np.asarray(table.scales)
        assert scales.min() >= 110 and scales.max() <= 134 and np.asarray(table.weights).any()


def test_a_checkpoint_missing_a_later_layer_is_refused_before_any_table(tmp_path, monkeypatch):
    """The model directory's checkpoint is resolved for every layer once,
    before any table is made: a checkpoint without the last layer's tensors
    is a CheckpointError naming it, and no table was created (nor loaded)."""
    from numa_engram.errors import CheckpointError
    from numa_engram.tables.table import SharedEngramTable

    first, last = SPEC.layer_ids[0], SPEC.layer_ids[-1]
    root = write_synthetic_model(tmp_path, SPEC, layers=[first])
    made = []
    monkeypatch.setattr(SharedEngramTable, "create",
                        classmethod(lambda cls, *a, **k: made.append(a) or pytest.fail("made")))
    with pytest.raises(CheckpointError, match=f"layers.{last}.|layer {last}") as err:
        EngramRuntime.from_pretrained(str(root), max_tokens=8, max_requests=2)
    assert made == [], err.value
