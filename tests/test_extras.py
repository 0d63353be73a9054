"""tests/extras.py's switch, on a test of its own in a pytest of its own: a missing extra skips the test that
needs it, and fails it where NBDDP_REQUIRE_EXTRAS=1 says every extra is installed (.ci/run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NEEDS_A_MISSING_EXTRA = '''
from tests.extras import need

def test_it():
    need("nbddp_no_such_extra")
'''


def _pytest(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_needing.py").write_text(NEEDS_A_MISSING_EXTRA)
    env = {k: v for k, v in os.environ.items() if k != "NBDDP_REQUIRE_EXTRAS"}
    env["PYTHONPATH"] = str(REPO)
    if require is not None:
        env["NBDDP_REQUIRE_EXTRAS"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "--rootdir", str(tmp_path), "--confcutdir", str(tmp_path), str(tmp_path / "test_needing.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_missing_extra_skips_its_test_and_fails_it_where_every_extra_must_be_installed(tmp_path):
    skipped = _pytest(tmp_path, None)
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout
    failed = _pytest(tmp_path, "1")
    assert failed.returncode == 1 and "1 failed" in failed.stdout, failed.stdout
    assert "NBDDP_REQUIRE_EXTRAS=1 (every extra installed), but nbddp_no_such_extra can't be imported" in failed.stdout
