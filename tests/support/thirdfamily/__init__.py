"""A third table family written the way docs/design.md's "Adding a family"
says, to prove it: four new modules (its spec and family, its checkpoint
reader, its table class, its model directory) and no edit of the package.
It holds Engram-shaped rows under its own name, spec type and config
marker, so every part above ``model/`` is found through the family alone;
its reader and table count their calls, so a test sees that they, not
Engram's, ran.  Installed through the ``numa_engram.families`` entry point
group (``entry_point_dir``) or ``register_family``."""

from __future__ import annotations

from pathlib import Path

ENTRY_POINT = "mirror = tests.support.thirdfamily.mirrorspec:MIRROR"


def entry_point_dir(root: Path) -> Path:
    """A directory that, on sys.path, installs the family by entry point (a
    distribution's metadata, as pip writes it)."""
    info = root / "mirror_family-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mirror-family\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[numa_engram.families]\n{ENTRY_POINT}\n")
    return root
