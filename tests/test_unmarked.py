"""A notebook with no cell marked: the cell that launches its library's training trains, and the earlier
cells it needs are its setup (:mod:`nbddp.notebook.unmarked`). (The run of one: ``test_frameworks``.)"""

import pytest

from nbddp.contracts.errors import CellError, NotebookError
from nbddp.notebook.cells import selection, training_cells
from nbddp.contracts.freevars import check_defined
from nbddp.notebook.reader import read_notebook
from nbddp.notebook.script import ExportOptions, generate
from tests.conftest import code, md
from tests.framework_notebooks import NOTEBOOKS


def chosen(notebook, cells, **options):
    """``(training cells, setup cells, note)`` of the notebook ``cells`` make."""
    picked = selection(read_notebook(notebook(cells)), **options)
    roles = [(c.cell.number, c.role) for c in picked.cells]
    return ([n for n, r in roles if r == "ddp-train"], [n for n, r in roles if r != "ddp-train"], picked.note)


@pytest.mark.parametrize("engine", sorted(NOTEBOOKS))
def test_each_librarys_unmarked_notebook_trains_its_launching_cell_with_the_cells_it_needs(notebook, engine):
    launch = {"accelerate": "notebook_launcher", "lightning": "trainer.fit", "transformers": "trainer.train"}[engine]
    training, setup, note = chosen(notebook, NOTEBOOKS[engine].unmarked_cells())
    assert (training, setup) == ([4], [1, 2])  # not 3 (a look at the model) nor 5 (the evaluation)
    assert note == (f"no cell is marked: cell 4 ({launch}) is the training cell, cells 1, 2 its setup; "
                    "cells 3, 5 run only in the kernel")
    script = generate(read_notebook(notebook(NOTEBOOKS[engine].unmarked_cells())))
    assert script.engine == engine and script.training == (4,) and script.note == note
    assert "# No cell is marked: cell 4" in script.text.split("\n\n")[0]  # said in the header
    assert "a look at the model" not in script.text
    compile(script.text, "train.py", "exec")


@pytest.mark.parametrize("build, launch, engine", [
    ("import lightning as L\ntrainer = L.Trainer(strategy='ddp_notebook', devices=2)", "trainer.fit(model, loader)",
     "lightning"),
    ("from transformers import Trainer, TrainingArguments\ntrainer = Trainer(model=model, args=TrainingArguments('o'))",
     "trainer.train()", "transformers"),
])
def test_a_trainer_built_in_a_cell_of_its_own_is_setup_and_plots_stay_in_the_kernel(notebook, build, launch, engine):
    cells = [md("# a notebook"),
             code("import torch\nimport matplotlib.pyplot as plt"),
             code("X = torch.randn(64, 4)\nloader = torch.utils.data.DataLoader(X, batch_size=8)\nmodel = torch.nn.Linear(4, 1)"),
             code("plt.plot(X[:, 0])\nplt.show()"),  # a plot
             code("X.shape"),  # exploration
             code(build),
             code(launch),
             code("print(model.weight)")]
    training, setup, note = chosen(notebook, cells)
    assert (training, setup) == ([7], [2, 3, 6])
    assert note.endswith("cells 2, 3, 6 its setup; cells 4, 5, 8 run only in the kernel")
    assert generate(read_notebook(notebook(cells))).engine == engine


def test_a_papermill_parameters_cell_alone_is_unmarked_and_stays_the_parameters_cell(notebook):
    cells = [code("epochs = 3\nseed = 0", "parameters"),
             code("from accelerate import notebook_launcher\nimport torch"),
             code("torch.manual_seed(seed)\nmodel = torch.nn.Linear(2, 1)"),
             code("def loop(model, epochs):\n    return model"),
             code("notebook_launcher(loop, args=(model, epochs), num_processes=2)")]
    picked = selection(read_notebook(notebook(cells)))
    assert [(c.cell.number, c.role) for c in picked.cells] == [
        (1, "parameters"), (2, "ddp"), (3, "ddp"), (4, "ddp"), (5, "ddp-train")]
    assert picked.note == "no cell is marked: cell 5 (notebook_launcher) is the training cell, cells 1-4 its setup"
    script = generate(read_notebook(notebook(cells)), ExportOptions(parameters={"epochs": 5}))
    assert script.text.index("epochs = 3") < script.text.index("epochs = 5") < script.text.index("def loop")


def test_the_value_the_training_sees_decides_which_cells_define_a_name(notebook):
    cells = [code("import lightning as L\nimport torch\nlr = 0.1"),                  # 1
             code("lr = 0.01  # tried a smaller one"),                                  # 2: lr's last value
             code("width = 8\nsmall = False"),                                          # 3: width's value may be this…
             code("if small:\n    width = 4"),                                          # 4 …or this
             code("model = torch.nn.Linear(width, 1)"),                                 # 5
             code("model = model.double()"),                                            # 6: read before bound
             code("torch.nn.init.zeros_(model.bias)"),                                  # 7: changes model in place
             code("print(model)"),                                                      # 8: looks only
             code("torch.manual_seed(0)"),                                              # 9: seeds what follows
             code("trainer = L.Trainer(max_epochs=1)\nopt_lr = lr"),                    # 10
             code("trainer.fit(model)")]                                                # 11
    training, setup, _ = chosen(notebook, cells)
    assert (training, setup) == ([11], [1, 2, 3, 4, 5, 6, 7, 9, 10])


def test_the_returned_variables_are_setup_too(notebook):
    cells = [code("import lightning as L"), code("net = 1"), code("trainer = L.Trainer()"), code("trainer.fit(model)")]
    assert chosen(notebook, cells)[1] == [1, 3]
    assert chosen(notebook, cells, returns=("net",))[1] == [1, 2, 3]


def test_a_needed_cell_that_reads_what_only_a_kernel_has_is_refused_naming_it_and_what_to_mark(notebook):
    cells = [code("import lightning as L"), code("trainer = L.Trainer()\ndisplay(trainer)"), code("trainer.fit(m)")]
    with pytest.raises(NotebookError, match=r"nb.ipynb: no cell is marked, and nbddp can't choose the setup of cell 3 "
                                            r"\(trainer.fit\).*cell 2, .*it defines 'trainer'.*uses 'display'.*start "
                                            r"cell 3 with '#\| ddp-train' and cells 1, 2 .*'#\| ddp'") as refused:
        selection(read_notebook(notebook(cells)))
    assert refused.value.exit_code == 2
    cells[1] = code("trainer = L.Trainer()\ndef show():\n    display(trainer)")  # a function nobody calls: fine
    assert chosen(notebook, cells)[1] == [1, 2]
    cells[2] = code("trainer.fit(None)\ndisplay(trainer)")  # the training cell's own: refused as a marked one's is
    with pytest.raises(CellError, match=r"cell 3, line 2: the training code uses 'display'.*No cell is marked, so "
                                        r"nbddp chose them: a mark turns that off; mark the training cell"):
        check_defined(generate(read_notebook(notebook(cells))))


def test_a_name_only_a_cell_nbddp_cant_export_may_define_is_refused_naming_that_cell(notebook):
    cells = [code("import lightning as L"), code("%run helpers.py"),
             code("m = 1\ntrainer = L.Trainer(callbacks=[Helper()])"), code("trainer.fit(m)")]
    with pytest.raises(NotebookError, match=r"cell 3 needs 'Helper', .*cell 2 may, but can't be exported "
                                            r"\('%run helpers.py': this IPython syntax changes what the code does"):
        selection(read_notebook(notebook(cells)))
    cells[1] = code("%%bash\necho unrelated")  # can't be exported either, but says nothing of Helper
    assert chosen(notebook, cells)[1] == [1, 3]


def test_a_parameters_cell_that_isnt_python_is_reported_only_when_the_notebook_trains(notebook):
    cells = [code("lr = = 1", "parameters"), code("import torch")]
    assert training_cells(read_notebook(notebook(cells))) == ()  # (papermill's engine then runs it as papermill does)
    cells.append(code("import lightning as L\nL.Trainer().fit(m)"))
    assert training_cells(read_notebook(notebook(cells))) == (3,)
    with pytest.raises(CellError, match="cell 1, line 1: SyntaxError"):
        selection(read_notebook(notebook(cells)))


def test_a_needed_cell_with_ipython_syntax_is_exported_as_a_marked_one_is(notebook):
    cells = [code("%matplotlib inline\n!pip install lightning\nimport lightning as L"), code("L.Trainer().fit(m)")]
    picked = selection(read_notebook(notebook(cells)))
    assert picked.cells[0].code.startswith("# %matplotlib inline  # nbddp:")
    with pytest.raises(CellError, match="cell 2, line 1: SyntaxError"):  # the training cell's errors are its own
        selection(read_notebook(notebook([code("import lightning as L"), code("L.Trainer().fit(m) +")])))


def test_without_marks_or_a_librarys_launch_there_is_no_training_cell_and_the_error_says_what_to_mark(notebook):
    cells = [code("import torch\nmodel = torch.nn.Linear(2, 1)"), code("model.train()"),  # torch's, not a Trainer's
             code("for x in data:\n    model(x).sum().backward()\n    opt.step()")]
    path = notebook(cells)
    with pytest.raises(NotebookError, match=r"nb.ipynb: no training cell. Mark the cell that trains: start it with "
                                            r"'#\| ddp-train'.*Cell 3 calls .backward\(\).*notebook_launcher") as error:
        selection(read_notebook(path))
    assert error.value.exit_code == 2 and training_cells(read_notebook(path)) == ()
    assert training_cells(read_notebook(notebook([code("x = 1", "parameters"), *cells[:2],
                                                  code("import lightning as L\nL.Trainer().fit(model)")]))) == (4,)


def test_one_marked_cell_turns_the_choice_off(notebook):
    cells = [*NOTEBOOKS["lightning"].unmarked_cells()]
    cells[1] = code("#| ddp\n" + cells[1].source)  # setup marked, the training not
    with pytest.raises(NotebookError, match="no training cell"):
        selection(read_notebook(notebook(cells)))
    cells[3] = code("#| ddp-train\n" + cells[3].source)
    assert chosen(notebook, cells) == ([4], [2], None)  # as marked: cell 1 only in the kernel
