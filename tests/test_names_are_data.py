"""Names are data: nothing of a notebook's name or path, a folder's, a script's, a markdown line or a ``-p`` value
becomes code in the generated script.

Each place a user's string goes into the script is tried with names that end a comment line (``\\n``, ``\\r``),
look like a line's end (U+2028, U+2029, U+0085), reorder what an editor shows (U+202E), or hold quotes, ``#`` and
what a shell reads (``$(…)``, backticks, ``;``): the script must compile to exactly the statements of the same
notebook's script under a plain name (comments and string constants aside). A real run of a notebook named with
the reported proof of concept (a newline, then code) trains and runs nothing else:
tests/test_shared_machine.py's run on one machine.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

from nbddp.notebook.reader import read_notebook
from nbddp.notebook.script import ExportOptions, as_comment, generate
from tests.conftest import code, md, write_notebook

PAYLOAD = "import os; os.system('touch PWNED')#"
#: Names as hostile as a file system allows (no "/" or NUL): each would, spliced raw, end a comment or a string.
HOSTILE = {
    "newline": f"poc\n{PAYLOAD}",
    "carriage return": f"poc\r{PAYLOAD}",
    "line separator": f"poc\u2028{PAYLOAD}",
    "paragraph separator": f"poc\u2029{PAYLOAD}",
    "next line": f"poc\x85{PAYLOAD}",
    "bidi override": f"poc\u202e{PAYLOAD}",
    "quotes and hash": f"""po'c"''"#{PAYLOAD}""",
    "shell": "poc $(touch PWNED) `touch PWNED`; touch PWNED &",
}
CELLS = [code("lr = 0.1", "parameters"), code("#| ddp\nimport math\nbase = 2"),
         code("#| ddp-train\nresult = base * lr\nprint('trained', result)")]


def statements(text: str) -> str:
    """What the script does: its syntax tree with every string constant blanked (a name may be in one, as data)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.dump(tree)


def script_of(folder: Path, name: str, cells=CELLS, **options) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    return generate(read_notebook(write_notebook(folder / f"{name}.ipynb", cells)), ExportOptions(**options)).text


@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_comment_holds_any_text_on_one_line(text):
    line = f"# {as_comment(text)}\nx = 1\n"
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(line).readline) if t.type not in (tokenize.NL,)]
    assert [tokenize.tok_name[t.type] for t in tokens][:2] == ["COMMENT", "NAME"], tokens
    assert len(as_comment(text).splitlines()) == 1
    assert "\u202e" not in as_comment(text) and "\t" in as_comment("a\tb")  # (a tab is text)


@pytest.mark.parametrize("kind", list(HOSTILE), ids=list(HOSTILE))
def test_the_notebooks_name_and_folder_stay_in_the_header(tmp_path, kind):
    hostile = HOSTILE[kind]
    plain = script_of(tmp_path / "plain", "nb", script_dir=tmp_path / "plain")
    folder = tmp_path / hostile.replace("/", "_")
    named = script_of(folder, hostile, script_dir=tmp_path)  # (the header's `nbddp run PATH` names the folder too)
    named_absolute = script_of(folder, hostile)  # (no script folder: the absolute path)
    assert statements(named) == statements(plain) == statements(named_absolute)
    assert "nbddp run '" in named  # (a shell word: pasted into a shell, the path is one argument)


@pytest.mark.parametrize("kind", list(HOSTILE), ids=list(HOSTILE))
def test_a_script_name_markdown_and_a_parameter_value_stay_data(tmp_path, kind):
    hostile = HOSTILE[kind]
    cells = [md(f"# Title\n{hostile}"), *CELLS]
    plain = script_of(tmp_path / "a", "nb", cells, parameters={"lr": "x"})
    named = script_of(tmp_path / "b", "nb", cells, keep_markdown=True, script_name=f"{hostile}.py",
                      parameters={"lr": hostile})
    assert statements(named) == statements(plain)
    tree = ast.parse(named)
    assigned = [n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "lr"]
    assert assigned[-1] == hostile  # (-p wins, as a literal that reads back as the value given)


@pytest.mark.parametrize("engine", ["catalyst", "torch"])
def test_each_engines_launch_hint_quotes_the_script_name(tmp_path, engine):
    named = script_of(tmp_path, "nb", engine=engine, script_name="my run; touch PWNED.py")
    launch = next(line for line in named.splitlines() if line.startswith("# Launch:"))
    assert "'my run; touch PWNED.py'" in launch, launch
