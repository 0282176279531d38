"""numa-engram profile: the rows a text corpus reads, through the model's own
tokenizer and hashing, and the fraction of reads a memory budget serves
(what ``plan --profile`` takes to judge the mapped tier)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator

import numpy as np

from ..errors import SpecError
from ..userfiles import printable, read_regular
from .args import emit, parse_size

MAX_CORPUS_BYTES = 1 << 30  # per file
DEFAULT_BUDGETS = "64M,256M,1G,4G,16G,64G"


def cmd_profile(args: argparse.Namespace) -> int:
    """Count each layer's row reads over the corpus, then the page reads a
    budget of each size serves, hottest pages first."""
    from ..store import accessprofile as ap

    model, tokenizer = _open_model(args.model_dir)
    spec = model.spec
    tokens = 0
    rows: dict[int, list[np.ndarray]] = {layer: [] for layer in spec.layer_ids}
    for path in args.corpus:
        ids = np.asarray(tokenizer.encode(_read_text(path), add_special_tokens=False).ids,
                         dtype=np.int64)
        tokens += len(ids)
        for layer, layer_rows in _rows_read(model, ids):
            rows[layer].append(layer_rows)
    if not tokens:
        raise SpecError("the corpus has no tokens: give text files the model's tokenizer "
                        "reads (UTF-8)")
    layers = [ap.LayerCounts.of(layer, np.concatenate(parts)) for layer, parts in rows.items()]
    per_layer = [ap.page_reads(c, spec.row_regions()) for c in layers]
    cumulative = ap.hottest_first(np.concatenate(per_layer))
    doc = _document(args, spec, tokens, layers, per_layer, cumulative)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(doc, fh)
    emit(args, doc, _text(args, doc))
    return 0


def _open_model(path: str):
    """The model directory (Engram or PLE) and its tokenizer.json's tokenizer."""
    from ..runtime.modeldir import TOKENIZER_FILE, read_tokenizer
    from ..runtime.modeldirs import open_model_directory

    if not os.path.isdir(path):
        raise SpecError(f"{printable(path)!r} is not a model directory; pass the directory "
                        "holding config.json and tokenizer.json")
    tokenizer_path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.lexists(tokenizer_path):
        raise SpecError(f"{printable(path)} has no {TOKENIZER_FILE}: a profile hashes the "
                        "corpus through the model's own tokenizer")
    tokenizer = read_tokenizer(tokenizer_path)
    return open_model_directory(path, tokenizer), tokenizer


def _read_text(path: str) -> str:
    data = read_regular(path, "the corpus file", limit=MAX_CORPUS_BYTES, error=SpecError)
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise SpecError(f"the corpus file {printable(path)} is not UTF-8 text (byte "
                        f"{exc.start}); give text files") from None


def _rows_read(model, ids: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(layer, rows of its whole table) for one document's tokenizer ids, as
    serving hashes them (the model's family: Engram through a HashState,
    PLE through ple_ids)."""
    from ..model.families import family_of

    return family_of(model.spec).document_rows(model, ids)


def _document(args: argparse.Namespace, spec, tokens: int, layers, per_layer,
              cumulative: np.ndarray) -> dict:
    from ..store import accessprofile as ap

    total = int(cumulative[-1]) if len(cumulative) else 0
    return {
        "format": ap.FORMAT, "model": os.path.abspath(args.model_dir),
        "corpus": [os.path.abspath(p) for p in args.corpus], "tokens": tokens,
        "table_bytes": int(spec.table_bytes()), "page_size": ap.PAGE,
        "row_regions": [list(r) for r in spec.row_regions()],
        "page_reads": total, "working_set_bytes": len(cumulative) * ap.PAGE,
        "layers": [{"layer": c.layer, "row_reads": int(c.counts.sum()),
                    "distinct_rows": len(c.rows), "pages_read": len(p),
                    "page_reads": int(p.sum()),
                    **({"rows": c.rows.tolist(), "counts": c.counts.tolist()} if args.rows
                       else {})} for c, p in zip(layers, per_layer)],
        "budgets": [{"bytes": b, "pages": b // ap.PAGE,
                     "fraction": ap.served_fraction(cumulative, b)} for b in args.budget],
        "curve": ap.curve(cumulative),
    }


def _text(args: argparse.Namespace, doc: dict) -> str:
    from ..units import fmt_bytes, text_table

    head = (f"{printable(doc['model'])}: {doc['tokens']:,} tokens of {len(doc['corpus'])} "
            f"corpus file(s); tables {fmt_bytes(doc['table_bytes'])}, pages read "
            f"{fmt_bytes(doc['working_set_bytes'])} ({doc['page_reads']:,} page reads: a row "
            "read counts once on each 4 KiB page of its weights and scales)")
    layers = text_table(
        ["layer", "row reads", "distinct rows", "pages read", "of the layer"],
        [[c["layer"], f"{c['row_reads']:,}", f"{c['distinct_rows']:,}", f"{c['pages_read']:,}",
          f"{c['pages_read'] * 4096 / doc['table_bytes'] * len(doc['layers']):.2%}"]
         for c in doc["layers"]])
    budgets = text_table(["budget", "pages", "reads served (hottest pages first)"],
                         [[fmt_bytes(b["bytes"]), f"{b['pages']:,}", f"{b['fraction']:.2%}"]
                          for b in doc["budgets"]])
    out = [head, layers, budgets]
    if args.out:
        out.append(f"written: {printable(args.out)} (numa-engram plan --profile reads it)")
    return "\n".join(out)


def budget_list(text: str) -> list[int]:
    """'64M,1G' -> byte counts, each > 0."""
    return [parse_size(part) for part in text.split(",") if part.strip()] or [parse_size(text)]


HELP = ("the rows a text corpus reads through the model's tokenizer and hashing, per layer, "
        "and the fraction of reads a memory budget serves (for plan --profile)")


def add_arguments(sp: argparse.ArgumentParser) -> None:
    """``numa-engram profile``'s arguments."""
    sp.add_argument("model_dir", metavar="MODEL_DIR",
                    help="a model directory: config.json and tokenizer.json (no weights needed)")
    sp.add_argument("corpus", metavar="CORPUS", nargs="+", help="UTF-8 text files")
    sp.add_argument("--budget", type=budget_list, default=DEFAULT_BUDGETS,
                    help="memory budgets to report, comma-separated (e.g. 1G,4G)")
    sp.add_argument("--out", default=None, help="write the profile as JSON here")
    sp.add_argument("--rows", action="store_true",
                    help="each layer's rows and their read counts in the JSON too (~30 bytes "
                    "a row read: 60 MiB for 150k tokens of V4.1)")
