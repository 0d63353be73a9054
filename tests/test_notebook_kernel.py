"""The kernel beside the job: what it reads of a failing cell, and the error it raises in the training cell's place."""

import pytest

from nbddp.doors.notebook_kernel import cell_line, raise_code
from nbddp.errors import RunFailed, RunTimeout

# IPython's traceback of In[7] calling a function defined in In[3], as the kernel sends it (with its colours).
TRACEBACK = ("\x1b[0;31mAssertionError\x1b[0m                            Traceback (most recent call last)\n"
             "Cell \x1b[0;32mIn[7], line 2\x1b[0m\n      1 x = 1\n\x1b[0;32m----> 2\x1b[0m check(x)\n\n"
             "Cell \x1b[0;32mIn[3], line 4\x1b[0m, in \x1b[0;36mcheck\x1b[0;34m(x)\x1b[0m\n"
             "\x1b[0;32m----> 4\x1b[0m \x1b[38;5;28;01massert\x1b[39;00m x > 2\n")


@pytest.mark.parametrize("count, line", [(7, 2), (3, 4), (5, None), (None, None)])
def test_the_line_is_the_failing_cells_own(count, line):
    assert cell_line(TRACEBACK, count) == line


@pytest.mark.parametrize("error", [
    RunFailed("cell 5 raised", exc_type="AssertionError", exc_message="(True, 39.61)", cell=5, line=3),
    RunTimeout("too slow", exit_code=124, rank=1, run_dir="/runs/r"),
])
def test_the_error_raised_in_the_training_cells_place_is_the_same_error(error):
    with pytest.raises(type(error)) as raised:
        exec(raise_code(error), {})
    assert str(raised.value) == str(error)
    assert [getattr(raised.value, name) for name in error.FIELDS] == [getattr(error, name) for name in error.FIELDS]
