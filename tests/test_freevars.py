"""Names a script reads but never defines, and which of those reads run with the script."""

from nbddp.contracts.freevars import cell_names, executed_reads, free_names


def test_free_names_skip_builtins_imports_and_definitions():
    code = "import os\nfrom x import y\nclass C: pass\ndef f(a):\n    return a + g + os.sep\nprint(z, y, C, f)\n"
    assert sorted(free_names(code)) == ["g", "z"]
    assert free_names("from m import *\nprint(q)") == []


def test_reads_inside_functions_only_run_when_called():
    code = ("def helper(v=default):\n    return display(v)\n"
            "class K:\n    field = klass_level\n"
            "data = [item for item in source]\n"
            "f = lambda: lazy\n")
    reads = executed_reads(code)
    assert {"default", "klass_level", "source"} <= set(reads) and reads["source"] == 5
    assert "display" not in reads and "lazy" not in reads


def test_a_cells_names_say_what_it_needs_from_earlier_cells_and_what_it_binds():
    names = cell_names("import torch\nfrom torch import nn\n"
                       "model = nn.Linear(4, 1)\nmodel = model.to(device)\n"  # bound here first: not needed
                       "net = net.to(device)\n"  # read on the line that binds it: the earlier one is needed
                       "steps += 1\n"  # read first
                       "if debug:\n    lr = 0.5\n"
                       "def loop():\n    return data + model\n"  # a global read inside a function counts
                       "[i for i in range(3)]\n")
    assert set(names.needs) == {"device", "net", "steps", "debug", "data"}
    assert names.defines == {"torch", "nn", "model", "net", "steps", "lr", "loop"}
    assert names.surely_defines == names.defines - {"lr"}  # bound only when debug is true
    assert names.imports == {"torch", "nn"}
    assert cell_names("from helpers import *\nrun()").star_import


def test_names_are_read_alike_on_every_python():
    """Comprehensions keep their names (Python 3.12 inlines them, PEP 709, and its symtable lists them with the
    module's); a walrus in one binds in the module; ``match`` and ``global`` bind; ``type`` (3.12+) binds."""
    import sys

    code = ("x = [i for i in range(3)]\nd = {k: v for k, v in y.items()}\nz = [x for x in x]\n"  # (the first x: the module's)
            "[w := t for t in q]\ndef f(a=[j for j in r]):\n    global g\n    g = a\n"
            "nested = [[u for u in row] for row in m]\nclass C:\n    vals = [c for c in cs]\n"
            "match cmd:\n    case [a0, *rest]:\n        pass\n"
            "display([t.shape for t in (X, Y)])\n")
    if sys.version_info >= (3, 12):
        code += "type Alias = list[int]\n"
    names = cell_names(code)
    assert set(names.needs) == {"y", "q", "r", "m", "cs", "cmd", "display", "X", "Y"}
    assert names.defines == {"x", "d", "z", "w", "f", "g", "nested", "C", "a0", "rest",
                             *(["Alias"] if sys.version_info >= (3, 12) else [])}
    assert free_names("[i for i in range(3)]\nprint(len([t.shape for t in (X, Y)]))") == ["X", "Y"]


def test_a_cell_that_changes_an_object_in_place_or_seeds_says_so():
    names = cell_names("model.apply(init)\n"  # a method called for its effect
                       "cfg['lr'] = 0.1\nopt.param_groups[0]['lr'] *= 2\n"  # stores into an item
                       "nn.init.zeros_(head.bias)\nX.clamp_(0, 1)\n"  # torch's in-place convention
                       "df.dropna(inplace=True)\n"
                       "data.head()\nsample = images[0].reshape(8, 8)\nplt.imshow(sample)\n"  # looking, not changing
                       "def later():\n    hidden.append(1)\n")  # runs only when called
    assert names.changes == {"model", "cfg", "opt", "nn", "head", "X", "df"}  # (nn: a module, which the choice ignores)
    assert not names.seeds and cell_names("torch.manual_seed(0)").seeds and cell_names("L.seed_everything(1)").seeds


def test_kernel_only_names_are_those_its_running_code_reads_without_defining():
    assert cell_names("x = 1\ndisplay(x)").kernel_only == ("display",)
    assert cell_names("def show(x):\n    display(x)").kernel_only == ()  # only if someone calls it
    assert cell_names("from IPython.display import display\ndisplay(1)").kernel_only == ()
