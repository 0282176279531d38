"""`numa-engram profile`: a corpus hashed through a synthetic model's own
tokenizer.json gives each layer's row counts equal to a count made by hand
from the hash ids (the DEAD image token included); the fraction of page
reads a budget serves, exact for a crafted case and monotone in the budget;
bad corpora refused by name."""

import contextlib
import io
import json

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="the 'tokenizers' extra is not installed")

from numa_engram import EngramSpec, write_synthetic_model  # noqa: E402
from numa_engram.cli.app import main  # noqa: E402
from numa_engram.store import accessprofile as ap  # noqa: E402

C = 40  # compressed ids; the last is the image token


def run(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A synthetic model whose tokenizer splits on whitespace (its word-level
    vocabulary as written: w0..w39, aliases W0..W15 sharing ids)."""
    from tokenizers import pre_tokenizers

    from numa_engram.runtime.modeldir import read_tokenizer

    spec = EngramSpec.small(rows_per_head=3000, n_head_per_ngram=2, head_dim=64,
                            compressed_vocab_size=C)
    root = write_synthetic_model(tmp_path_factory.mktemp("profile") / "m", spec, shards=1)
    tok = read_tokenizer(str(root / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    return root


def corpus(path, seed, n):
    rng = np.random.default_rng(seed)
    hot = rng.integers(0, 6, n)  # most words from a few: a skewed profile
    words = [f"w{h}" if rng.random() < 0.7 else
             ("<|image|>" if rng.random() < 0.05 else
              (f"W{rng.integers(0, 16)}" if rng.random() < 0.3 else f"w{rng.integers(0, C - 1)}"))
             for h in hot]
    path.write_text(" ".join(words))
    return words


def by_hand(model_dir, documents):
    """Each layer's {row: reads}: tokenizer ids from the vocabulary, the
    compression map, DEAD for the image token, sequence_hashes, table_rows."""
    from numa_engram.model.hashing import compress_ids, sequence_hashes, table_rows
    from numa_engram.runtime.modeldir import ModelDirectory

    m = ModelDirectory.open(model_dir)
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    counts = {layer: {} for layer in m.spec.layer_ids}
    for words in documents:
        ids = np.array([vocab[w] for w in words])
        compressed = compress_ids(ids, m.token_map)
        compressed[np.isin(ids, m.dead_ids)] = -1
        for layer in m.spec.layer_ids:
            rows = table_rows(m.spec, sequence_hashes(m.spec, compressed, layer), layer)
            for r in rows.reshape(-1).tolist():
                counts[layer][r] = counts[layer].get(r, 0) + 1
    return counts


def test_counts_equal_a_count_by_hand_from_the_hash_ids(model, tmp_path):
    docs = [corpus(tmp_path / "a.txt", 1, 3000), corpus(tmp_path / "b.txt", 2, 1500)]
    assert any("<|image|>" in d for d in docs) and any(w.startswith("W") for w in docs[0])
    out = tmp_path / "p.json"
    code, text = run("profile", str(model), str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
                     "--budget", "4K,64K,1M", "--out", str(out), "--rows")
    assert code == 0, text
    doc = json.loads(out.read_text())
    assert doc["tokens"] == 4500
    expected = by_hand(model, docs)
    for layer in doc["layers"]:
        assert dict(zip(layer["rows"], layer["counts"])) == expected[layer["layer"]]
        assert layer["row_reads"] == 4500 * 4  # 2 orders (2- and 3-grams) x 2 heads
    fractions = [b["fraction"] for b in doc["budgets"]]
    assert fractions == sorted(fractions) and 0 < fractions[0] < 1
    curve = doc["curve"]
    assert all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(curve, curve[1:]))
    assert curve[-1] == [doc["working_set_bytes"], 1.0]
    assert "reads served" in text and "plan --profile" in text
    code, _ = run("profile", str(model), str(tmp_path / "a.txt"), "--out", str(out))
    assert code == 0 and "rows" not in json.loads(out.read_text())["layers"][0]  # --rows only


def test_page_reads_and_budgets_are_exact_for_a_crafted_case():
    # weights 256 B per row (16 a page), scales 8 B (512 a page)
    layer = ap.LayerCounts.of(1, np.repeat([0, 1, 16, 600], [5, 3, 2, 1]))
    assert layer.rows.tolist() == [0, 1, 16, 600] and layer.counts.tolist() == [5, 3, 2, 1]
    reads = ap.page_reads(layer, (("weights", 256), ("scales", 8)))
    # weights: page 0 rows 0,1 (8), page 1 row 16 (2), page 37 row 600 (1);
    # scales: page 0 rows 0,1,16 (10), page 1 row 600 (1)
    assert sorted(reads.tolist()) == [1, 1, 2, 8, 10]
    cum = ap.hottest_first(reads)
    assert [ap.served_fraction(cum, k * 4096) for k in range(7)] == \
        [0, 10 / 22, 18 / 22, 20 / 22, 21 / 22, 1.0, 1.0]
    assert ap.served_fraction(cum, 4095) == 0  # whole pages only
    # a row of 3000 bytes spans pages: row 1 is bytes 3000..5999, pages 0 and 1
    spans = ap.page_reads(ap.LayerCounts.of(1, np.array([1, 1, 2])), (("weights", 3000),))
    assert sorted(spans.tolist()) == [1, 2, 3]  # page 0: row 1 x2; page 1: rows 1, 2; page 2: row 2
    points = ap.curve(cum)
    assert points[-1] == [5 * 4096, 1.0] and ap.curve_fraction(points, 5 * 4096) == 1.0
    assert ap.curve_fraction(points, 2 * 4096) == pytest.approx(18 / 22)


@pytest.mark.parametrize("case", ["binary", "directory", "empty"])
def test_a_bad_corpus_is_refused_by_name(model, tmp_path, case, capsys):
    path = tmp_path / "c"
    if case == "binary":
        path.write_bytes(b"w1 \xff\xfe w2")
    elif case == "directory":
        path.mkdir()
    else:
        path.write_text("")
    code = main(["profile", str(model), str(path)])
    err = capsys.readouterr().err
    assert code == 2 and {"binary": "not UTF-8", "directory": "a directory",
                          "empty": "no tokens"}[case] in err, err


def test_a_ple_model_is_profiled_through_ple_ids(tmp_path):
    """A Qwen4-Exp directory (config.json and tokenizer.json, no weights):
    each layer's counts equal ple_ids_numpy's rows counted by hand, a row
    counted on every page it spans (4 KiB is no multiple of its bytes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from numa_engram.model.ple import PLESpec
    from numa_engram.model.plehashing import ple_ids_numpy

    from .support.ple_scenarios import write_ple_model

    spec = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=500, eos_token_id=7,
                   ngram_vocab_size_base=3000, split_ngram_parts=7, dtype="bfloat16")
    model = tmp_path / "qwen4-exp"
    write_ple_model(model, spec)
    (model / "model.safetensors").unlink()  # the profile reads no weights
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(500)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model / "tokenizer.json"))
    ids = np.random.default_rng(3).zipf(1.3, 2000) % 500
    (tmp_path / "c.txt").write_text(" ".join(f"t{i}" for i in ids))
    code, _ = run("profile", str(model), str(tmp_path / "c.txt"), "--rows",
                  "--out", str(tmp_path / "p"))
    assert code == 0
    doc = json.loads((tmp_path / "p").read_text())
    width = spec.row_bytes
    assert doc["row_regions"] == [["weights", width]] and 4096 % width
    for layer in doc["layers"]:
        rows, counts = np.unique(ple_ids_numpy(spec, layer["layer"], ids), return_counts=True)
        assert layer["rows"] == rows.tolist() and layer["counts"] == counts.tolist()
        spanning = ((rows + 1) * width - 1) // 4096 != rows * width // 4096
        assert spanning.any()
        assert layer["page_reads"] == int(counts.sum() + counts[spanning].sum())
