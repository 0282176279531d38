"""tests/README.md's map names every test file, and only files that exist:
a test file it leaves out is one a reader looking for a behaviour's test
never finds."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
README = TESTS / "README.md"


def _mapped(readme: Path = README) -> set[str]:
    """The files in the map's "test module" column (its second)."""
    names: set[str] = set()
    for line in readme.read_text().splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 3:
            names.update(re.findall(r"`([^`/]+\.py)`", cells[2]))
    return names


def test_every_test_file_is_in_the_readmes_map():
    files = {p.name for p in TESTS.glob("test_*.py")}
    missing = sorted(files - _mapped())
    assert not missing, (f"tests/README.md's map leaves out {missing}: add a line for each "
                         "(the behaviour it tests | the file | the code it tests)")


def test_every_file_the_map_names_exists():
    stale = sorted(name for name in _mapped() if not (TESTS / name).is_file())
    assert not stale, f"tests/README.md's map names {stale}, which tests/ does not hold"


def test_the_map_is_read_from_its_test_module_column_only(tmp_path):
    # a file named only in the behaviour or code column, or in prose, is not mapped
    readme = tmp_path / "README.md"
    readme.write_text("Prose names `test_p.py`.\n\n| behaviour | test module | code |\n"
                      "| --- | --- | --- |\n"
                      "| `test_x.py` | `test_a.py`, `test_b.py` | `test_c.py`, `cli/` |\n")
    assert _mapped(readme) == {"test_a.py", "test_b.py"}
