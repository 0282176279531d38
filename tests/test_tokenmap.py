"""build_token_map and EngramSpec.from_config against plain restatements
of DeepSeek V4.1's rules, on tokenizers built here in memory."""

import json
import re
import unicodedata

import numpy as np
import pytest

from numa_engram import EngramSpec, build_token_map
from numa_engram.errors import SpecError, SpecMismatchError

tokenizers = pytest.importorskip("tokenizers", reason="the 'tokenizers' extra is not installed")


def plain_normalise(text: str) -> str:
    """V4.1's normaliser sequence restated with the standard library."""
    text = unicodedata.normalize("NFKC", text)
    text = unicodedata.normalize("NFD", text)
    text = "".join(c for c in text if unicodedata.category(c) != "Mn")
    text = text.lower()
    text = re.sub(r"[ \t\r\n]+", " ", text)
    text = "\ue000" if text == " " else text
    return text.strip().replace("\ue000", " ")


def plain_map(tok) -> tuple[list[int], int]:
    keys, out = {}, []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=False)
        key = tok.id_to_token(i) if "\ufffd" in text else (plain_normalise(text) or text)
        out.append(keys.setdefault(key, len(keys)))
    return out, len(keys)


def word_level():
    from tokenizers import Tokenizer, models

    words = ["[UNK]", "Hello", "hello", "HÉLLO", "héllo", " ", "  ", "\t", "\n\n", "a  b",
             "a b", "ﬁ", "fi", "Café", "cafe", "Ｗｉｄｅ", "wide", "x", " x "]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.add_special_tokens(["<|image|>", "<｜begin▁of▁sentence｜>"])
    return tok


def byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    merges = [("Ã", "©"), ("Ġ", "h"), ("Ġh", "e")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.mark.parametrize("make", [word_level, byte_level])
def test_token_map_equals_the_plain_rule(make):
    tok = make()
    table, size = build_token_map(tok)
    want, want_size = plain_map(tok)
    assert size == want_size and table.tolist() == want
    assert table.dtype == np.int64 and len(table) == tok.get_vocab_size(with_added_tokens=True)


def test_token_map_ties_as_v41_does():
    tok = word_level()
    table, _ = build_token_map(tok)
    ids = {w: tok.token_to_id(w) for w in ("Hello", "hello", "HÉLLO", "héllo", " ", "  ", "\t",
                                            "a  b", "a b", "ﬁ", "fi", "Café", "cafe", "x", " x ")}
    same = [("Hello", "hello"), ("hello", "HÉLLO"), ("HÉLLO", "héllo"), (" ", "  "),
            (" ", "\t"), ("a  b", "a b"), ("ﬁ", "fi"), ("Café", "cafe"), ("x", " x ")]
    for a, b in same:
        assert table[ids[a]] == table[ids[b]], (a, b)
    assert table[ids[" "]] != table[ids["x"]], "a lone space keeps its own key"
    assert table[tok.token_to_id("<|image|>")] != table[ids["x"]]


def test_partial_utf8_byte_tokens_key_by_their_raw_string():
    tok = byte_level()
    table, _ = build_token_map(tok)
    a, b = tok.token_to_id("Ã"), tok.token_to_id("©")
    assert "\ufffd" in tok.decode([a]) and table[a] != table[b]
    assert tok.decode([tok.token_to_id("Ã©")]) == "é"  # whole: text, accent stripped
    assert table[tok.token_to_id("Ã©")] == table[tok.token_to_id("e")]


# ------------------------------------------------------------- config --

def v41_config(spec: EngramSpec, pad_tokenizer_id: int, size: int, nested=False, rows=None):
    doc = {"engram_layer_ids": list(spec.layer_ids),
           "engram_vocab_size": spec.engram_vocab_sizes[0],
           "engram_max_ngram_size": spec.max_ngram_size,
           "engram_n_heads": spec.n_head_per_ngram, "engram_head_dim": spec.head_dim,
           "engram_compressed_vocab_size": size, "engram_pad_id": pad_tokenizer_id,
           "engram_num_embeddings": rows or [spec.rows(layer) for layer in spec.layer_ids]}
    return {"model_type": "deepseek_v4", "text_config": doc} if nested else doc


def test_from_config_maps_the_pad_id_and_checks_sizes(tmp_path):
    table, size = build_token_map(word_level())
    ref = EngramSpec.small(rows_per_head=500, compressed_vocab_size=size)
    pad_tok = 3  # "HÉLLO"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(v41_config(ref, pad_tok, size, nested=True)))
    spec = EngramSpec.from_config(str(path), (table, size))
    assert spec.pad_id == int(table[pad_tok]) and spec.rows(1) == ref.rows(1)
    assert spec.compressed_vocab_size == size
    with pytest.raises(SpecError, match="needs token_map"):
        EngramSpec.from_config(v41_config(ref, pad_tok, size), None)
    with pytest.raises(SpecMismatchError, match="engram_compressed_vocab_size is 7"):
        EngramSpec.from_config(v41_config(ref, pad_tok, 7), (table, size))
    bad = v41_config(ref, pad_tok, size, rows=[ref.rows(1) + 1, ref.rows(14)])
    with pytest.raises(SpecMismatchError, match=f"engram_num_embeddings is {ref.rows(1) + 1} "
                                                f"but its primes sum to {ref.rows(1)}"):
        EngramSpec.from_config(bad, (table, size))
