"""Names a script reads but never defines, and which of those reads run with the script."""

from nbddp.notebook.freevars import executed_reads, free_names


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
