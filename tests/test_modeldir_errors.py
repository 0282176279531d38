"""A model directory's bad files are NumaEngramErrors naming the file and
the field, whether read by the library or by ``plan --model``; the
runtime's size arguments are checked for type and range."""

import json
import os
import shutil

import pytest

from numa_engram import EngramRuntime, EngramSpec, write_synthetic_model
from numa_engram.cli.app import main
from numa_engram.errors import NumaEngramError
from numa_engram.runtime.modeldir import CONFIG_FILE, TOKENIZER_FILE, ModelDirectory

SPEC = EngramSpec.small(rows_per_head=100, n_head_per_ngram=2, head_dim=64, max_ngram_size=3)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("good"), SPEC)


@pytest.fixture
def model(good, tmp_path):
    """A copy of a good model directory's config and tokenizer to spoil."""
    root = tmp_path / "model"
    root.mkdir()
    for name in (CONFIG_FILE, TOKENIZER_FILE):
        shutil.copy(good / name, root / name)
    return root


def _config(root, change):
    doc = json.loads((root / CONFIG_FILE).read_text())
    change(doc)
    (root / CONFIG_FILE).write_text(json.dumps(doc))


def _with_token_map(value):
    def change(doc):
        doc["text_config"]["engram_token_map"] = value
    return change


def _spoil(root, case):
    if case == "config.json a directory":
        (root / CONFIG_FILE).unlink()
        (root / CONFIG_FILE).mkdir()
        return CONFIG_FILE, CONFIG_FILE
    if case == "config.json binary":
        (root / CONFIG_FILE).write_bytes(b"\xff\xfe\x00garbage")
        return CONFIG_FILE, "not JSON"
    if case == "image_token_id 10^30":
        _config(root, lambda d: d.update(image_token_id=10**30))
        return CONFIG_FILE, "image_token_id"
    if case == "image_token_id a string":
        _config(root, lambda d: d.update(image_token_id="7"))
        return CONFIG_FILE, "image_token_id"
    if case == "garbage tokenizer.json":
        (root / TOKENIZER_FILE).write_text('{"model": {"type": "nonsense"}}')
        return TOKENIZER_FILE, "tokenizer"
    if case.startswith("engram_token_map"):
        (root / TOKENIZER_FILE).unlink()
        value = {"engram_token_map of strings": ["a", "b"],
                 "engram_token_map a dict": {"0": 1},
                 "engram_token_map 10^20": [0, 10**20]}[case]
        _config(root, _with_token_map(value))
        return CONFIG_FILE, "engram_token_map"
    raise AssertionError(case)


CASES = ["config.json a directory", "config.json binary", "image_token_id 10^30",
         "image_token_id a string", "garbage tokenizer.json", "engram_token_map of strings",
         "engram_token_map a dict", "engram_token_map 10^20"]


@pytest.mark.parametrize("case", CASES)
def test_each_bad_file_is_an_error_naming_the_file_and_field(model, case):
    file, field = _spoil(model, case)
    with pytest.raises(NumaEngramError) as err:
        ModelDirectory.open(model)
    assert file in str(err.value) and field in str(err.value), str(err.value)


@pytest.mark.parametrize("case", ["config.json a directory", "config.json binary",
                                  "garbage tokenizer.json"])
def test_plan_model_names_the_file_and_exits_2(model, case, capsys):
    file, field = _spoil(model, case)
    assert main(["plan", "--model", str(model), "--tp", "1"]) == 2
    err = capsys.readouterr().err
    assert file in err and field in err and "Traceback" not in err, err


@pytest.mark.parametrize("name, value", [
    ("max_tokens", "64"), ("max_tokens", 2.5), ("max_tokens", 10**12), ("max_tokens", 0),
    ("max_requests", None), ("max_requests", 2.5), ("max_requests", 10**20),
    ("max_requests", True)])
def test_runtime_sizes_of_wrong_types_or_sizes_are_refused_by_name(good, name, value):
    with pytest.raises(NumaEngramError, match=f"{name} must be an integer from 1 to"):
        EngramRuntime.from_pretrained(good, **{name: value})
    assert os.path.isdir(good)


OPEN_IN_A_CHILD = """
import sys
from numa_engram.errors import NumaEngramError
from numa_engram.runtime.modeldir import ModelDirectory
from numa_engram.runtime.plemodeldir import PLEModelDirectory
try:
    {"ModelDirectory": ModelDirectory, "PLEModelDirectory": PLEModelDirectory}[sys.argv[1]].open(
        sys.argv[2])
except NumaEngramError as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("opener, name", [("ModelDirectory", CONFIG_FILE),
                                          ("ModelDirectory", TOKENIZER_FILE),
                                          ("PLEModelDirectory", CONFIG_FILE)])  # (no tokenizer)
def test_a_fifo_in_the_directory_is_refused_by_name_without_blocking(model, opener, name):
    """config.json or tokenizer.json a FIFO: an error naming it, at once
    (the open used to block until a writer came; tokenizers' own open
    blocked in native code holding the GIL, deaf to SIGTERM).  In a child
    process killed at a timeout, so a regression fails instead of hanging
    the run."""
    import subprocess

    from .conftest import run_python

    (model / name).unlink()
    os.mkfifo(model / name)
    try:
        child = run_python(OPEN_IN_A_CHILD, opener, str(model), timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{opener}.open blocked on {name}, a FIFO")
    assert child.returncode == 0, child.stderr[-2000:]
    assert f"{model / name} is a FIFO, not a regular file" in child.stdout, child.stdout
