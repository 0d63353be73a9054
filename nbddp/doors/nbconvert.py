"""``jupyter nbconvert --to nbddp notebook.ipynb``: the same script as ``nbddp export``.

Registered through the ``nbconvert.exporters`` entry point. The source map
travels as an extra output file, which nbconvert's FilesWriter writes beside
the script.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbconvert.exporters import Exporter
from traitlets import Enum, Unicode

from nbddp.notebook.reader import from_nbformat
from nbddp.plan.options import choices, parse_returns
from nbddp.notebook.script import ExportOptions, generate

if TYPE_CHECKING:
    from nbformat import NotebookNode


class NbddpExporter(Exporter):
    """Export the tagged cells of a notebook as a guarded DDP training script."""

    export_from_notebook = "DDP training script (nbddp)"
    output_mimetype = "text/x-python"

    engine = Enum([*choices("engine"), "auto"], default_value="auto",
                  help="DDP engine; 'auto' detects it from the training cells").tag(config=True)
    returns = Unicode("model", help="comma-separated variables to return").tag(config=True)

    def _file_extension_default(self) -> str:
        return ".py"

    def from_notebook_node(self, nb: NotebookNode, resources: dict[str, Any] | None = None,
                           **kw: Any) -> tuple[str, dict[str, Any]]:
        nb_copy, resources = super().from_notebook_node(nb, resources, **kw)
        meta = resources.get("metadata", {})
        name = meta.get("name", "notebook")
        path = Path(meta.get("path", ".")) / f"{name}.ipynb"
        options = ExportOptions(
            engine=None if self.engine == "auto" else self.engine,
            returns=parse_returns(self.returns),
            script_name=f"{name}.py",
            script_dir=path.parent,  # nbconvert writes beside the notebook unless told otherwise
        )
        script = generate(from_nbformat(nb_copy, path), options)
        # "./": FilesWriter makes the dirname of each output, and makedirs("") fails.
        resources.setdefault("outputs", {})[f"./{name}.py.map.json"] = script.source_map.to_json().encode()
        resources["output_files_dir"] = "."  # nbconvert says "Support files will be in" this: beside the script
        return script.text, resources
