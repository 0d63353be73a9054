"""The parameters cell: declared names and defaults, and overrides checked against them."""

import pytest

from nbddp.contracts.errors import ParameterError
from nbddp.notebook.reader import read_notebook
from nbddp.notebook.literals import parse_value, to_literal
from nbddp.notebook.parameters import check_overrides, declared_parameters, type_notices
from nbddp.notebook.script import ExportOptions, generate
from tests.conftest import code


def test_declared_defaults_keep_literals_and_name_expressions(notebook):
    nb = read_notebook(notebook([
        code("lr = 0.1\nepochs: int = 3\nname = 'x'\nsteps = epochs * 10\na, b = 1, 2", "parameters"),
        code("#| ddp\nhidden = 5"),
        code("#| ddp-train\npass"),
    ]))
    assert declared_parameters(nb) == {"lr": 0.1, "epochs": 3, "name": "x", "steps": {"expression": "epochs * 10"},
                                       "a": {"expression": "1, 2"}, "b": {"expression": "1, 2"}}
    assert generate(nb, ExportOptions(parameters={"lr": 0.5})).parameters == {
        "lr": 0.5, "epochs": 3, "name": "x", "steps": {"expression": "epochs * 10"},
        "a": {"expression": "1, 2"}, "b": {"expression": "1, 2"}}


def test_unknown_override_is_refused_listing_the_known_names(notebook):
    nb = read_notebook(notebook([code("lr = 0.1\nepochs = 3", "parameters"), code("#| ddp-train\npass")]))
    assert check_overrides(nb, {"lr": 1}) == {"lr": 0.1, "epochs": 3}
    with pytest.raises(ParameterError, match="unknown parameter learning_rate; the parameters cell defines lr, epochs"
                                             r"\. Did you mean lr\?"):
        check_overrides(nb, {"learning_rate": 0.1})


@pytest.mark.parametrize("typed, meant", [("learning_rate", "lr"), ("lr", "learning_rate"), ("LR", "lr"),
                                          ("epoch", "epochs"), ("batchsize", "batch_size"), ("seed", None)])
def test_the_closest_declared_name_is_the_one_a_typo_meant(typed, meant):
    from nbddp.notebook.parameters import closest_parameter

    declared = ["learning_rate", "epochs", "batch_size"] if typed == "lr" else ["lr", "epochs", "batch_size"]
    assert closest_parameter(typed, declared) == meant


def test_any_override_needs_a_parameters_cell(notebook):
    nb = read_notebook(notebook([code("#| ddp-train\npass")]))
    assert check_overrides(nb, {}) == {}
    with pytest.raises(ParameterError, match="unknown parameter lr: the notebook has no 'parameters' cell"):
        check_overrides(nb, ["lr"])


def test_an_annotation_alone_declares_a_parameter(notebook):
    nb = read_notebook(notebook([code("lr: float\nepochs = 2", "parameters"), code("#| ddp-train\npass")]))
    assert declared_parameters(nb) == {"lr": {"annotation": "float"}, "epochs": 2}
    assert check_overrides(nb, {"lr": 0.1})


def test_an_override_whose_type_differs_from_its_default_is_said_once_each():
    declared = {"lr": 0.05, "epochs": 3, "name": "x", "flag": True, "steps": {"expression": "epochs * 10"},
                "seed": None, "sizes": [1, 2]}
    assert type_notices(declared, {"lr": 1, "epochs": 2.5, "name": "y", "flag": False, "steps": "a", "seed": 3,
                                   "sizes": [3]}) == ()  # numbers are numbers; an expression or None has no type
    # text meant (quoted on a command line, a str in Python) is said; so is any other literal of another type
    assert type_notices(declared, {"lr": "abc", "name": 3, "flag": 1, "sizes": "1,2"}) == (
        "warning: parameter lr = 'abc' is text, but the notebook's default 0.05 is a number: the cells get 'abc' as it "
        "is.",
        "warning: parameter name = 3 is a number, but the notebook's default 'x' is text: the cells get 3 as it is.",
        "warning: parameter flag = 1 is a number, but the notebook's default True is a bool: the cells get 1 as it is.",
        "warning: parameter sizes = '1,2' is text, but the notebook's default [1, 2] is a list: the cells get '1,2' as "
        "it is.")


def test_unquoted_text_for_a_default_that_isnt_text_is_refused_saying_how_to_pass_text():
    declared = {"lr": 0.05, "name": "x"}
    assert type_notices(declared, {"name": parse_value("plain words")}) == ()  # text for text: as it is
    with pytest.raises(ParameterError) as refused:
        type_notices(declared, {"lr": parse_value("abc")})
    assert str(refused.value) == ("-p lr abc: the notebook's lr is 0.05, a number, and 'abc' reads as no Python literal "
                                  "(a typo?). Give a number, or quote the text to pass it as it is: -p lr \"'abc'\". "
                                  "(see: docs/troubleshooting.md#a-p-value-that-reads-as-no-python-literal)")
    assert refused.value.exit_code == 2
    assert type_notices(declared, {"lr": parse_value("'abc'")})  # quoted: text meant, said
    assert to_literal(parse_value("abc")) == "'abc'" and type(parse_value("0.1")) is float
