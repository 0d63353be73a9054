"""``jupyter nbconvert --to nbddp`` gives the same script as ``nbddp export``."""

import subprocess
import sys

from nbddp.doors.cli import main
from tests.conftest import code


def test_nbconvert_exporter_matches_nbddp_export(notebook, tmp_path):
    path = notebook([code("lr = 0.1", "parameters"), code("#| ddp\nimport math"), code("#| ddp-train\nprint(lr)")], name="demo.ipynb")
    done = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "nbddp", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from_nbconvert = (tmp_path / "demo.py").read_text()
    assert (tmp_path / "demo.py.map.json").exists()
    assert "Support files will be in ./" in done.stderr and not (tmp_path / "demo_files").exists()
    assert main(["export", str(path), "-o", str(tmp_path / "demo.py")]) == 0  # the same place
    assert from_nbconvert == (tmp_path / "demo.py").read_text()
    assert "#     or: nbddp run demo.ipynb " in from_nbconvert


def test_the_header_names_the_notebook_from_where_the_script_is(notebook, tmp_path):
    path = notebook([code("#| ddp-train\nmodel = torch.nn.Linear(1, 1)")], name="demo.ipynb")
    assert main(["export", str(path), "-o", str(tmp_path / "deep" / "er" / "t.py")]) == 0
    header = (tmp_path / "deep" / "er" / "t.py").read_text().split("\n\n")[0]
    assert "#     or: nbddp run ../../demo.ipynb " in header
    assert "# Weights: rank 0 saves model to t.weights.pt beside this script" in header


def test_exporter_is_registered_as_entry_point():
    from nbconvert.exporters import get_exporter

    assert get_exporter("nbddp").__name__ == "NbddpExporter"
