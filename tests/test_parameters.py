"""Parameters are data, never code: names checked, values round-trip exactly."""

import ast

import pytest

from nbddp.contracts.errors import ParameterError
from nbddp.notebook.literals import assignments, check_name, parse_pairs, parse_value, to_literal


@pytest.mark.parametrize("name", ["x=1\nimport os#", "1lr", "lr rate", "", "class", "None", "a.b", "x;y"])
def test_bad_names_are_rejected(name):
    with pytest.raises(ParameterError, match="not a valid Python variable name"):
        check_name(name)


def test_good_names_pass():
    assert check_name("learning_rate") == "learning_rate"
    assert check_name("λ") == "λ"


@pytest.mark.parametrize(
    "value",
    [
        "it's \"quoted\"",
        "line1\nline2\r\n",
        "back\\slash\\",
        "unicode: é 漢字 🎉",
        "nul\x00byte",
        "x" * 1_000_000,
        "'''; import os; '''",
        0.1,
        -3,
        10**40,
        True,
        None,
        [1, "a", (2.5, None)],
        {"k": [1, 2], "n": {"deep": "v"}},
        float("inf"),
        float("nan"),
    ],
)
def test_values_round_trip_exactly(value):
    line = assignments({"p": value})[0]
    namespace = {}
    exec(line, namespace)  # what the script does
    got = namespace["p"]
    if value != value:  # nan
        assert got != got
    else:
        assert got == value and type(got) is type(value)


def test_non_data_values_are_refused():
    with pytest.raises(ParameterError, match="can't be passed to the ranks"):
        to_literal(object())


def test_written_value_is_a_single_literal_expression():
    text = to_literal("a'); __import__('os').system('echo pwned'); ('")
    assert isinstance(ast.parse(text, mode="eval").body, ast.Constant)


@pytest.mark.parametrize(
    "text, value",
    [("0.01", 0.01), ("3", 3), ("True", True), ("None", None), ("[1, 2]", [1, 2]),
     ("adam", "adam"), ("'quoted'", "quoted"), ("1e-3", 0.001), ("os.system('x')", "os.system('x')")],
)
def test_command_line_values_are_literals_else_strings(text, value):
    assert parse_value(text) == value


def test_parse_pairs_checks_names():
    assert parse_pairs([("lr", "0.1"), ("opt", "adam")]) == {"lr": 0.1, "opt": "adam"}
    with pytest.raises(ParameterError):
        parse_pairs([("import", "1")])
