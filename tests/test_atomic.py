"""`anelm.atomic`: what is written gets the umask's modes, not mkstemp's private ones, and a
build killed mid-way leaves nothing that survives the next build of the same target."""

import os
import stat
import subprocess
import sys

from anelm.atomic import atomic_dir, atomic_open


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_files_and_folders_get_the_umasks_modes(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_open(tmp_path / "f.json", "w") as f:
            f.write("{}")
        with atomic_dir(tmp_path / "folder") as d:
            (d / "x").write_text("x")
    finally:
        os.umask(old)
    assert mode(tmp_path / "f.json") == 0o644 and mode(tmp_path / "folder") == 0o755


def test_a_killed_builds_leftovers_go_at_the_next_build(tmp_path):
    out = tmp_path / "export"
    code = (f"import os; from anelm.atomic import atomic_dir\n"
            f"with atomic_dir({str(out)!r}) as d:\n"
            f"    (d / 'weights').write_bytes(b'x' * 1000)\n"
            f"    os._exit(9)  # killed mid-build: no cleanup runs")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    strays = [p.name for p in tmp_path.iterdir()]
    assert len(strays) == 1 and strays[0].startswith(".export.") and not out.exists()
    mine = tmp_path / f".export.{os.getpid()}.live.tmp"  # a running writer's: kept
    mine.mkdir()
    with atomic_dir(out) as d:
        (d / "weights").write_bytes(b"y")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["export", mine.name])
