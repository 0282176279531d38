import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from numa_engram.checkpoints.checkpoint import TensorNames, load_rows
from numa_engram.checkpoints.synthetic import synthetic_layer, write_synthetic_checkpoint
from numa_engram.errors import CheckpointError
from numa_engram.model.sharding import shard_heads
from numa_engram.model.spec import EngramSpec

SPEC = EngramSpec.small(rows_per_head=300, n_head_per_ngram=4, head_dim=64)  # 8 heads


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "engram.safetensors"
    return write_synthetic_checkpoint(path, SPEC, raw=True)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("threads", [1, 3])
def test_every_shard_reads_back_exactly(ckpt, tp, threads):
    for layer in SPEC.layer_ids:
        w_all, s_all = synthetic_layer(SPEC, layer, raw=True)
        for rank in range(tp):
            if (tp - 1) * -(-SPEC.n_hash_cols // tp) >= SPEC.n_hash_cols:
                pytest.skip(f"{tp} shards of {SPEC.n_hash_cols} heads is not head-wise valid")
            info = shard_heads(SPEC.bucket_sizes(layer), tp, rank)
            w = np.zeros((info.num_rows, 64), np.uint8)
            s = np.zeros((info.num_rows, 2), np.uint8)
            seen = []
            load_rows(ckpt, SPEC, layer, info.row_start, info.row_end, w, s, chunk_bytes=4096,
                      progress=lambda d, t, acc=seen: acc.append((d, t)), threads=threads,
                      cpus=sorted(os.sched_getaffinity(0)))
            np.testing.assert_array_equal(w, w_all[info.row_start:info.row_end])
            np.testing.assert_array_equal(s, s_all[info.row_start:info.row_end])
            assert seen[-1][0] == seen[-1][1] == info.num_rows * SPEC.row_bytes
            assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # monotonic


def test_files_hold_real_fp8_dtypes(ckpt):
    from safetensors import safe_open

    with safe_open(str(ckpt), framework="pt") as f:
        w_name, s_name = TensorNames().of(1)
        assert f.get_tensor(w_name).dtype == torch.float8_e4m3fn
        assert f.get_tensor(s_name).dtype == torch.float8_e8m0fnu


def test_missing_tensor_wrong_shape_and_dtype(tmp_path, ckpt):
    w = np.zeros((10, 64), np.uint8)
    s = np.zeros((10, 2), np.uint8)
    with pytest.raises(CheckpointError, match="is in none of"):
        load_rows(ckpt, SPEC, 1, 0, 10, w, s, names=TensorNames("nope.{layer}", "x.{layer}"))
    bad = tmp_path / "bad.safetensors"
    w_name, s_name = TensorNames().of(1)
    save_file({w_name: torch.zeros((5, 64), dtype=torch.uint8),
               s_name: torch.zeros((SPEC.rows(1), 2), dtype=torch.float32)}, str(bad))
    with pytest.raises(CheckpointError, match=r"has shape \[5, 64\]"):
        load_rows(bad, SPEC, 1, 0, 10, w, s)
    save_file({w_name: torch.zeros((SPEC.rows(1), 64), dtype=torch.uint8),
               s_name: torch.zeros((SPEC.rows(1), 2), dtype=torch.float32)}, str(bad))
    with pytest.raises(CheckpointError, match="dtype F32"):
        load_rows(bad, SPEC, 1, 0, 10, w, s)
    with pytest.raises(CheckpointError, match="outside layer"):
        load_rows(ckpt, SPEC, 1, 0, SPEC.rows(1) + 1, w, s)
    with pytest.raises(CheckpointError, match="destination shapes"):
        load_rows(ckpt, SPEC, 1, 0, 11, w, s)


NAMINGS = {
    "v4.1": TensorNames("layers.{layer}.engram.embed.weight", "layers.{layer}.engram.embed.scale"),
    "model-prefix": TensorNames("model.layers.{layer}.engram.embed.weight",
                                "model.layers.{layer}.engram.embed.scale"),
    "vllm-scale-inv": TensorNames("model.layers.{layer}.engram.embed.weight",
                                  "model.layers.{layer}.engram.embed.weight_scale_inv"),
    "ours-before": TensorNames("layers.{layer}.engram.embedding.weight",
                               "layers.{layer}.engram.embedding.scale"),
}


@pytest.mark.parametrize("naming", sorted(NAMINGS))
def test_sharded_checkpoint_with_an_index_loads_bit_exact_under_each_naming(tmp_path, naming):
    root = write_synthetic_checkpoint(tmp_path / "ckpt", SPEC, names=NAMINGS[naming], shards=3)
    assert (root / "model.safetensors.index.json").exists()
    assert len(list(root.glob("*.safetensors"))) == 3
    for layer in SPEC.layer_ids:
        info = shard_heads(SPEC.bucket_sizes(layer), 2, 1)
        w = np.empty((info.num_rows, SPEC.head_dim), np.uint8)
        s = np.empty((info.num_rows, SPEC.scales_per_row), np.uint8)
        load_rows(str(root), SPEC, layer, info.row_start, info.row_end, w, s)
        w_all, s_all = synthetic_layer(SPEC, layer)
        np.testing.assert_array_equal(w, w_all[info.row_start:info.row_end])
        np.testing.assert_array_equal(s, s_all[info.row_start:info.row_end])


def test_ambiguous_or_missing_tensors_and_spec_mismatch_are_refused(tmp_path):
    from numa_engram.errors import SpecMismatchError

    w = np.empty((10, SPEC.head_dim), np.uint8)
    s = np.empty((10, SPEC.scales_per_row), np.uint8)
    both = tmp_path / "both"
    both.mkdir()
    write_synthetic_checkpoint(both / "a.safetensors", SPEC, names=NAMINGS["v4.1"])
    write_synthetic_checkpoint(both / "b.safetensors", SPEC, names=NAMINGS["model-prefix"])
    with pytest.raises(CheckpointError, match=r"2 weights tensors among the known names "
                                              r"\['layers.1.engram.embed.weight', "
                                              r"'model.layers.1.engram.embed.weight'\]"):
        load_rows(str(both), SPEC, 1, 0, 10, w, s)
    other = tmp_path / "other.safetensors"
    write_synthetic_checkpoint(other, SPEC, names=TensorNames("emb.{layer}.w", "emb.{layer}.s"))
    with pytest.raises(CheckpointError, match="no weights tensor"):
        load_rows(str(other), SPEC, 1, 0, 10, w, s)
    load_rows(str(other), SPEC, 1, 0, 10, w, s, names=TensorNames("emb.{layer}.w",
                                                                   "emb.{layer}.s"))
    theirs = tmp_path / "theirs.safetensors"
    write_synthetic_checkpoint(theirs, EngramSpec.small(seed=5))
    with pytest.raises(SpecMismatchError, match="was written for spec"):
        load_rows(str(theirs), EngramSpec.small(), 1, 0, 10, w, s)


# --------------------------------------------- hostile and broken files --

def _index(root, weight_map_text: str):
    (root / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": ' + weight_map_text + "}")


def _sharded(tmp_path):
    return write_synthetic_checkpoint(tmp_path / "ckpt", SPEC, shards=2)


def _dest(n=10):
    return np.empty((n, SPEC.head_dim), np.uint8), np.empty((n, SPEC.scales_per_row), np.uint8)


@pytest.mark.parametrize("target", ["/etc/hostname", "../secret.txt", "sub/../../secret.txt"])
def test_index_entries_may_not_leave_the_checkpoint_directory(tmp_path, target):
    root = _sharded(tmp_path)
    (tmp_path / "secret.txt").write_text("SECRET-CONTENTS-1234")
    w_name, s_name = TensorNames().of(1)
    _index(root, f'{{"{w_name}": "{target}", "{s_name}": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(CheckpointError) as err:
        load_rows(str(root), SPEC, 1, 0, 10, *_dest())
    text = str(err.value)
    assert "model.safetensors.index.json" in text and w_name in text and target in text
    assert "outside the checkpoint directory" in text and "SECRET" not in text


def test_a_file_that_is_not_safetensors_is_never_quoted(tmp_path):
    text_file = tmp_path / "notes.safetensors"
    text_file.write_text("SECRET-CONTENTS-1234 and more text to be long enough")
    with pytest.raises(CheckpointError) as err:
        load_rows(str(text_file), SPEC, 1, 0, 10, *_dest())
    import struct
    first8 = struct.unpack("<Q", b"SECRET-C")[0]
    assert "SECRET" not in str(err.value) and str(first8) not in str(err.value)
    assert "not a safetensors header length" in str(err.value)


def test_symlinks_inside_the_directory_may_point_anywhere(tmp_path):
    """The Hugging Face cache: snapshot entries are symlinks into blobs/."""
    (tmp_path / "blobs").mkdir()
    real = write_synthetic_checkpoint(tmp_path / "blobs" / "x.safetensors", SPEC)
    snap = tmp_path / "snapshot"
    snap.mkdir()
    (snap / "model.safetensors").symlink_to(real)
    w_name, s_name = TensorNames().of(1)
    _index(snap, f'{{"{w_name}": "model.safetensors", "{s_name}": "model.safetensors"}}')
    w, s = _dest()
    load_rows(str(snap), SPEC, 1, 0, 10, w, s)
    np.testing.assert_array_equal(w, synthetic_layer(SPEC, 1)[0][:10])


@pytest.mark.parametrize("weight_map, text", [
    ('["a", "b"]', "no 'weight_map' object"),
    ('{"layers.1.engram.embed.weight": 7}', "maps to a int, not a file name"),
    ("[" * 100_000 + "]" * 100_000, "not a safetensors index"),
    ('{"layers.1.engram.embed.weight": "model-00001-of-00002.safetensors", '
     '"layers.1.engram.embed.weight": "model-00002-of-00002.safetensors"}', "is mapped twice"),
])
def test_a_malformed_index_is_a_checkpoint_error(tmp_path, weight_map, text):
    root = _sharded(tmp_path)
    _index(root, weight_map)
    with pytest.raises(CheckpointError, match=text):
        load_rows(str(root), SPEC, 1, 0, 10, *_dest())


def test_the_same_tensor_in_two_files_names_both(tmp_path):
    both = tmp_path / "both"
    both.mkdir()
    write_synthetic_checkpoint(both / "a.safetensors", SPEC)
    write_synthetic_checkpoint(both / "b.safetensors", SPEC)
    with pytest.raises(CheckpointError, match=r"is in both .*a\.safetensors and .*b\.safetensors"):
        load_rows(str(both), SPEC, 1, 0, 10, *_dest())


def _rewrite_header(path, edit):
    """Rewrite a safetensors file's JSON header through ``edit(header)``."""
    import json
    import struct

    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    payload = data[8 + size:]
    path.write_bytes(struct.pack("<Q", len(text)) + text + payload)


@pytest.mark.parametrize("damage, text", [
    ("truncate", r"tensor 'layers\.\d+\.engram\.embed\.\w+' needs bytes up to \d+ but the file "
                 r"has \d+: truncated or corrupt"),
    ("past-end", r"tensor 'layers\.1\.engram\.embed\.weight' needs bytes up to \d+ but the file "
                 r"has \d+"),
    ("lies", r"tensor 'layers\.1\.engram\.embed\.weight' is F8_E4M3 \[\d+, 64\] \(\d+ bytes\), "
             r"but its data_offsets span \d+ bytes"),
])
def test_corrupt_files_name_the_file_the_tensor_and_both_sizes(tmp_path, damage, text):
    path = write_synthetic_checkpoint(tmp_path / "c.safetensors", SPEC)
    w_name, _ = TensorNames().of(1)
    if damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 1000)
    elif damage == "past-end":
        _rewrite_header(path, lambda h: h[w_name]["data_offsets"].__setitem__(
            1, h[w_name]["data_offsets"][1] + 10**9))
    else:
        _rewrite_header(path, lambda h: h[w_name]["data_offsets"].__setitem__(
            1, h[w_name]["data_offsets"][1] - 64))
    with pytest.raises(CheckpointError, match=f"{path}: " + text):
        load_rows(str(path), SPEC, 1, 0, 10, *_dest())


def test_tensors_that_overlap_are_refused_as_safetensors_refuses_them(tmp_path):
    """Layer 14's weights pointed at layer 1's bytes (each entry sound
    alone): refused naming both, for either layer's load."""
    import safetensors

    path = write_synthetic_checkpoint(tmp_path / "o.safetensors", SPEC)
    w1, _ = TensorNames().of(1)
    w14, _ = TensorNames().of(14)

    def alias(header):
        begin, end = header[w14]["data_offsets"]
        start = header[w1]["data_offsets"][0]
        header[w14]["data_offsets"] = [start, start + end - begin]
    _rewrite_header(path, alias)
    with pytest.raises(Exception):  # noqa: B017 (the reference: safetensors refuses it too)
        safetensors.safe_open(str(path), framework="numpy")
    for layer in (1, 14):
        with pytest.raises(CheckpointError, match=r"tensors '.*' and '.*' overlap"):
            load_rows(str(path), SPEC, layer, 0, 10, *_dest())


# -------------------------------------------- one version, resolved once --

def test_a_wrong_tensor_name_fails_before_anything_is_allocated(tmp_path):
    """A V4-sized table (about 190 GiB): the checkpoint is resolved before any
    capacity check or allocation, so the error is the checkpoint's, at once."""
    import time

    from numa_engram import SharedEngramTable
    from numa_engram.model.sharding import shard_heads

    from .conftest import shm_files

    big = EngramSpec.named("v4-flash")
    shard = shard_heads(big.bucket_sizes(1), 1, 0)  # primes found before the clock starts
    path = tmp_path / "other.safetensors"
    save_file({"something.else": torch.zeros((4, 4), dtype=torch.uint8)}, str(path))
    before = shm_files()
    t0 = time.thread_time()  # this thread's CPU time: the same on a loaded host
    with pytest.raises(CheckpointError, match="no weights tensor among the known names"):
        SharedEngramTable.create(big, 1, shard, checkpoint=str(path))
    assert time.thread_time() - t0 < 1.0
    assert shm_files() == before


def test_a_file_rewritten_during_the_load_is_refused(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c.safetensors", SPEC, raw=True)
    info_rows = SPEC.rows(1)
    w, s = _dest(info_rows)

    def rewrite(done, total):  # in place: same inode, new size and mtime
        if done < total:
            with open(path, "ab") as f:
                f.write(b"\0" * 8)
    with pytest.raises(CheckpointError, match="changed while the table loaded"):
        load_rows(str(path), SPEC, 1, 0, info_rows, w, s, chunk_bytes=4096, progress=rewrite)


def test_a_file_replaced_during_the_load_gives_rows_of_one_version(tmp_path):
    """os.replace mid-load: the descriptors opened at the start keep reading
    the old file, weights and scales alike, never a mix of the two."""
    path = write_synthetic_checkpoint(tmp_path / "c.safetensors", SPEC, seed=0, raw=True)
    other = write_synthetic_checkpoint(tmp_path / "v2.safetensors", SPEC, seed=1, raw=True)
    n = SPEC.rows(1)
    w, s = _dest(n)
    swapped = []

    def swap(done, total):
        if not swapped:
            os.replace(other, path)
            swapped.append(done)
    load_rows(str(path), SPEC, 1, 0, n, w, s, chunk_bytes=4096, progress=swap)
    old_w, old_s = synthetic_layer(SPEC, 1, seed=0, raw=True)
    assert swapped
    np.testing.assert_array_equal(w, old_w)
    np.testing.assert_array_equal(s, old_s)


def test_a_plan_refuses_a_file_replaced_since_it_was_resolved(tmp_path):
    from numa_engram.checkpoints.checkpoint import resolve

    path = write_synthetic_checkpoint(tmp_path / "c.safetensors", SPEC, seed=0)
    plan = resolve(str(path), SPEC, 1)
    os.replace(write_synthetic_checkpoint(tmp_path / "v2.safetensors", SPEC, seed=1), path)
    with pytest.raises(CheckpointError, match="changed since the checkpoint was resolved"):
        load_rows(plan, SPEC, 1, 0, 10, *_dest())


# ---------------------------------- one contract, both families' readers --

class _Family:
    """What a checkpoint contract needs of a table family: write a
    checkpoint, resolve a layer in it, load the layer's rows through a
    progress callback (called between chunks)."""

    def __init__(self, name):
        from numa_engram.model.ple import PLESpec

        self.name = name
        self.spec = SPEC if name == "engram" else PLESpec(
            layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
            ngram_vocab_size_base=3000, split_ngram_parts=7)
        self.layer = 1 if name == "engram" else 5

    def write(self, path, seed=0):
        from numa_engram.checkpoints.synthetic import write_ple_checkpoint

        if self.name == "engram":
            return write_synthetic_checkpoint(path, self.spec, seed=seed, raw=True)
        return write_ple_checkpoint(path, self.spec, seed=seed)

    def resolve(self, path):
        from numa_engram.checkpoints.checkpoint import resolve
        from numa_engram.checkpoints.plecheckpoint import resolve_ple

        if self.name == "engram":
            return resolve(str(path), self.spec, self.layer)
        return resolve_ple(str(path), self.spec, self.layer)

    def load(self, plan, progress=None):
        from numa_engram.checkpoints.plecheckpoint import load_ple_rows, read_scale

        n = self.spec.rows(self.layer)
        if self.name == "engram":
            w, s = _dest(n)
            load_rows(plan, self.spec, self.layer, 0, n, w, s, chunk_bytes=4096,
                      progress=progress)
            return [w, s]
        scale = np.float32(read_scale(plan))  # (read apart, before the rows)
        out = np.zeros((n, self.spec.row_bytes), np.uint8)
        load_ple_rows(plan, self.spec, 0, n, out, progress=progress)
        return [out, scale]


FAMILIES = ["engram", "ple"]


def _cut(path):
    """A progress hook that truncates ``path`` to half at its first call."""
    done = []

    def hook(d, t):
        if not done and d < t:
            os.truncate(path, os.path.getsize(path) // 2)
            done.append(d)
    return hook, done


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_truncated_during_the_load_is_refused_naming_it(tmp_path, family):
    fam = _Family(family)
    path = fam.write(tmp_path / "c.safetensors")
    hook, cut = _cut(path)
    with pytest.raises(CheckpointError) as err:
        fam.load(fam.resolve(path), hook)
    assert cut and str(path) in str(err.value), str(err.value)
    assert "truncated checkpoint" in str(err.value) or "changed while the table loaded" in \
        str(err.value), str(err.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_rewritten_during_the_load_is_refused(tmp_path, family):
    """In place (same inode, new size and mtime), after the first chunk:
    the rows read may be of two versions, so the load fails naming the
    file (PLE used to check only before its load)."""
    fam = _Family(family)
    path = fam.write(tmp_path / "c.safetensors")
    grown = []

    def rewrite(d, t):
        if not grown and d < t:
            with open(path, "ab") as f:
                f.write(b"\0" * 8)
            grown.append(d)
    with pytest.raises(CheckpointError, match="changed while the table loaded") as err:
        fam.load(fam.resolve(path), rewrite)
    assert grown and str(path) in str(err.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_replaced_since_it_was_resolved_is_refused(tmp_path, family):
    fam = _Family(family)
    path = fam.write(tmp_path / "c.safetensors")
    plan = fam.resolve(path)
    os.replace(fam.write(tmp_path / "v2.safetensors", seed=1), path)
    with pytest.raises(CheckpointError, match="changed since the checkpoint was resolved") as err:
        fam.load(plan)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_replaced_during_the_load_gives_rows_of_one_version(tmp_path, family):
    """os.replace mid-load: the descriptors opened at the start read the
    old file to the end, never a mix of the two versions."""
    fam = _Family(family)
    path = fam.write(tmp_path / "c.safetensors", seed=0)
    want = fam.load(fam.resolve(fam.write(tmp_path / "same.safetensors", seed=0)))
    other = fam.write(tmp_path / "v2.safetensors", seed=1)
    swapped = []

    def swap(d, t):
        if not swapped:
            os.replace(other, path)
            swapped.append(d)
    got = fam.load(fam.resolve(path), swap)
    assert swapped
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_swapped_for_a_fifo_after_resolving_is_refused_without_blocking(
        tmp_path, family):
    """The load opens the files again: a FIFO there now is refused naming
    it, never an open that waits for a writer (PLE's plain open did)."""
    import threading

    fam = _Family(family)
    path = fam.write(tmp_path / "c.safetensors")
    plan = fam.resolve(path)
    os.unlink(path)
    os.mkfifo(path)
    out = []

    def run():
        try:
            fam.load(plan)
        except BaseException as exc:
            out.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    blocked = thread.is_alive()
    if blocked:  # a writer, then EOF: the blocked open returns and the thread ends
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert not blocked, f"the {family} load blocked opening a FIFO"
    assert isinstance(out[0], CheckpointError), out
    assert f"checkpoint {path} is a FIFO, not a regular file" in str(out[0]), out[0]
