"""The benchmarks' random-read limit (tools/benchmarks/readlimit.py): a kernel of their own,
compiled at first use, reading every line of every row it is given."""

import numpy as np
import pytest

from tools.benchmarks.readlimit import read_rows


def test_read_rows_reads_every_line_of_every_row():
    table = np.random.default_rng(3).integers(0, 256, (1000, 256), dtype=np.uint8)
    rows = np.random.default_rng(4).integers(0, 1000, 5000)
    words = table.view(np.uint64)[:, ::8]  # the first word of each 64-byte line
    want = int(words[rows].sum(dtype=np.uint64))
    for threads in (1, 3):
        assert read_rows(table, rows, ahead=16, threads=threads) == want
    with pytest.raises(ValueError, match=r"rows must be in \[0, 1000\)"):
        read_rows(table, np.array([1000]))
