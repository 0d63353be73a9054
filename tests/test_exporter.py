"""``jupyter nbconvert --to nbddp`` gives the same script as ``nbddp export``."""

import subprocess
import sys

from nbddp.cli import main
from tests.conftest import code


def test_nbconvert_exporter_matches_nbddp_export(notebook, tmp_path):
    path = notebook([code("lr = 0.1", "parameters"), code("#| ddp\nimport math"), code("#| ddp-train\nprint(lr)")], name="demo.ipynb")
    done = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "nbddp", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from_nbconvert = (tmp_path / "demo.py").read_text()
    assert (tmp_path / "demo.py.map.json").exists()
    (tmp_path / "expected").mkdir(exist_ok=True)
    assert main(["export", str(path), "-o", str(tmp_path / "expected" / "demo.py")]) == 0
    assert from_nbconvert == (tmp_path / "expected" / "demo.py").read_text()


def test_exporter_is_registered_as_entry_point():
    from nbconvert.exporters import get_exporter

    assert get_exporter("nbddp").__name__ == "NbddpExporter"
