"""One options type and one argument definition for every front door."""

import argparse
import os
import re
from dataclasses import fields

import pytest

from nbddp.contracts.errors import UsageError
from nbddp.plan.options import (PROCESSES_PER_CPU, ArgumentParser, LaunchOptions, add_launch_arguments, launch_options,
                           parse_line)

CPUS = len(os.sched_getaffinity(0))


def parse(argv):
    parser = ArgumentParser(prog="nbddp run")
    add_launch_arguments(parser)
    return launch_options(parser.parse_args(argv))


def test_defaults_live_in_one_place():
    assert parse([]) == LaunchOptions()
    assert parse(["--collective-timeout", "0"]) == LaunchOptions(collective_timeout=0) == LaunchOptions(collective_timeout=None)
    assert LaunchOptions().collective_timeout == 300.0 and LaunchOptions().returns == ("model",)


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "0"], "--nproc 0: need at least 1 process"),
    (["--gpus", "0"], "--gpus 0: need at least 1 GPU"),
    (["--gpus", "two"], "--gpus 'two': give a number, 'all' or 'free'"),
    (["--cpu", "--gpus", "1"], "--cpu and --gpus contradict"),
    (["--timeout", "-1"], "--timeout -1: give a positive number of seconds"),
    (["--idle-timeout", "0"], "--idle-timeout 0: give a positive number of seconds"),
    (["--collective-timeout", "-5"], "--collective-timeout -5"),
    (["--timeout", "inf"], "--timeout inf"),
    (["--max-restarts", "-1"], "--max-restarts -1: give 0 or more"),
    (["--return", ","], "--return: name at least one variable"),
    (["--return", "not a name"], "--return 'not a name'"),
    (["-p", "x y", "1"], "-p: parameter name 'x y' is not a valid Python variable name"),
    (["--engine", "catalyst", "--max-restarts", "1"], "--max-restarts needs the torch engine"),
    (["--engine", "jax"], "argument --engine: invalid choice"),
    (["--nproc", "two"], "argument --nproc: invalid int value"),
    # absurd values that would otherwise fail deep inside torch, or fork until the kernel is killed
    (["--collective-timeout", "1e30"], "--collective-timeout 1e+30: give at most 31536000 seconds (a year)"),
    (["--timeout", "31536001"], "--timeout 3.1536e+07: give at most 31536000 seconds"),
    (["--nproc", "10000"], f"--nproc 10000: this machine has {CPUS} CPU"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "0.0.0.0:29500"],
     "--rdzv-endpoint 0.0.0.0:29500: 0.0.0.0 names every interface, not an address another node can dial"),
    (["--log-cap", "lots"], "--log-cap 'lots': give a size such as 100MB, 2GB or 500kB (0: no cap)."),
])
def test_bad_values_are_usage_errors_naming_the_option(argv, message):
    with pytest.raises(UsageError, match=re.escape(message)) as info:
        parse(argv)
    assert info.value.exit_code == 2


def test_round_trip_through_argv():
    """A batch hands each run its options as arguments: they must parse back to the same options."""
    options = LaunchOptions(cpu=True, nproc=3, engine="torch", returns=("model", "opt"), timeout=60.5,
                            collective_timeout=None, idle_timeout=9, max_restarts=2, run_dir=None,
                            parameters={"lr": 0.1, "name": "x y", "quoted": "'a'", "num_str": "1", "flag": True,
                                        "none": None, "items": [1, {"a": (2, 3)}], "text": "--looks-like-a-flag"})
    assert parse(options.to_argv()) == options


def test_help_in_a_magic_is_shown_not_an_error(capsys):
    parser = ArgumentParser(prog="%%ddp_train")
    add_launch_arguments(parser)
    assert parse_line(parser, "--help") is None
    assert "--max-restarts" in capsys.readouterr().out
    assert parse_line(parser, "--cpu --nproc 2 -p lr '0.5'") == argparse.Namespace(**{
        **vars(parser.parse_args([])), "cpu": True, "nproc": 2, "parameters": [["lr", "0.5"]]})


def test_several_nodes_and_slurm_round_trip_through_argv():
    from nbddp.plan.options import Nodes, SlurmRequest

    options = LaunchOptions(cpu=True, nproc=2, nodes=Nodes(2, 1, "node0:29500"), rdzv_timeout=30.0)
    assert parse(options.to_argv()) == options
    slurm = LaunchOptions(cpu=True, nproc=2, slurm=SlurmRequest(2, None, "gpu", "1:00:00", "a", (("qos", "high"),)))
    assert parse(slurm.to_argv()) == slurm
    for requeue in (True, False):  # a batch's runs get the requeue choice and bound too
        asked = LaunchOptions(slurm=SlurmRequest(requeue=requeue, max_requeues=5))
        assert parse(asked.to_argv()) == asked


def test_ray_options_round_trip_and_mean_what_they_mean_for_slurm(monkeypatch):
    from nbddp.plan.options import RayRequest

    assert parse(["--ray"]).ray == RayRequest("auto")
    assert parse(["--ray", "10.0.0.1:6379", "--nodes", "2", "--gpus-per-node", "4"]).ray == RayRequest("10.0.0.1:6379", 2, 4)
    for options in (LaunchOptions(cpu=True, nproc=3, ray=RayRequest()),
                    LaunchOptions(ray=RayRequest("ray://head:10001", 2, 1))):
        assert parse(options.to_argv()) == options
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    assert RayRequest().where() == "the Ray cluster at head:6379 (RAY_ADDRESS)"
    monkeypatch.delenv("RAY_ADDRESS")
    assert RayRequest().where() == "the Ray cluster started on this machine"


@pytest.mark.parametrize("argv, words", [
    (["--ray", "nb.ipynb"], "that is a notebook, not a cluster's address. Put the notebook first"),
    (["--ray", "head"], "--ray 'head': give the cluster's address (HOST:PORT of its head"),
    (["--ray", "--slurm"], "--slurm and --ray contradict each other"),
    (["--ray", "--gpus", "2"], "with --ray say --gpus-per-node G"),
    (["--ray", "--gpus-per-node", "1", "--nproc", "2"], "contradict"),
    (["--ray", "--max-restarts", "1"], "a --ray run isn't restarted"),
    (["--ray", "--engine", "catalyst"], "the catalyst engine spawns its own ranks"),
    (["--ray", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1"], "--ray chooses the nodes itself"),
    (["--ray", "--nodes", "0"], "--nodes 0: need at least 1 node"),
    (["--nodes", "2"], "--nodes: only with --slurm or --ray"),
])
def test_bad_ray_options_are_refused_naming_the_option(argv, words):
    with pytest.raises(UsageError, match=re.escape(words)):
        parse(argv)


@pytest.mark.parametrize("argv, words", [
    (["--nnodes", "2", "--node-rank", "0"], "need --nnodes N, --node-rank R and --rdzv-endpoint"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank 2: give 0 to 1"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h"], "give HOST:PORT of node 0"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1", "--max-restarts", "1"], "--max-restarts works on one machine"),
    (["--rdzv-timeout", "0"], "--rdzv-timeout 0"),
    (["--partition", "gpu"], "--partition: only with --slurm"),
    (["--slurm", "--gpus", "2"], "with --slurm say --gpus-per-node"),
    (["--slurm", "--gpus-per-node", "2", "--cpu"], "contradict"),
    (["--slurm", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1"], "--slurm chooses the nodes itself"),
    (["--slurm", "--time", "soon"], "--time 'soon'"),
    (["--slurm", "--slurm-arg", "qos"], "give KEY=VALUE"),
    (["--slurm", "--slurm-arg", "output=/x"], "nbddp sets --output itself"),
    (["--slurm", "--slurm-arg", "nodes=3"], "use nbddp's --nodes"),
    (["--slurm", "--slurm-arg", "array=1-3"], "depends on it for the run's job"),
    (["--slurm", "--slurm-arg", "export=NONE"], "depends on it for the run's job"),
    (["--slurm", "--partition", "a b"], "without spaces"),
    (["--requeue"], "--requeue/--no-requeue: only with --slurm"),
    (["--max-requeues", "2"], "--max-requeues: only with --slurm"),
    (["--slurm", "--max-requeues", "-1"], "--max-requeues -1: give 0 or more"),
    (["--slurm", "--slurm-arg", "signal=USR1@60"], "a job that requeues itself sets --signal itself; give --no-requeue"),
])
def test_bad_node_and_slurm_options_are_refused_naming_the_option(argv, words):
    with pytest.raises(UsageError, match=re.escape(words)):
        parse(argv)


# ---------------------------------------------------------------- one declaration, every rendering


def _door_parsers():
    """Each door's own parser, as the door builds it, and the argv words that come before its options."""
    import papermill  # noqa: F401 - first: papermill loads its engines, nbddp's among them, as it starts

    from nbddp.doors.cli import build_parser
    from nbddp.doors.jupyter.magics import _PARSER
    from nbddp.doors.papermill import options_parser
    from nbddp.plan.options import BATCH, EXPORT, MAGIC, PAPERMILL, RUN

    cli = build_parser()
    return {RUN: (cli, ["run", "nb.ipynb"]), BATCH: (cli, ["batch", "nb.ipynb", "--grid", "g.yaml"]),
            EXPORT: (cli, ["export", "nb.ipynb"]), MAGIC: (_PARSER, []), PAPERMILL: (options_parser(), [])}


def _flags(parser, prefix):
    if prefix:  # a command of the CLI: its own parser's flags
        import argparse

        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[prefix[0]]
    return {flag for action in parser._actions for flag in action.option_strings}


def _example(declaration):
    """Arguments that give ``declaration`` its example value: with the option it belongs to, or the others that
    make it (``--nnodes`` needs ``--node-rank`` and ``--rdzv-endpoint``)."""
    from nbddp.plan.option_fields import declared
    from nbddp.plan.options import LaunchOptions

    def words(d):
        return [d.option.flags[0], *d.option.example]

    parent = declaration.parent
    if parent is None:
        return words(declaration)
    if parent.option.flags:
        return [parent.option.flags[0], *words(declaration)]
    return [word for d in declared(LaunchOptions) if d.parent == parent for word in words(d)]


def test_every_option_appears_in_every_rendering():
    """One declaration per option: each door's parser, ``nbddp.run()``'s and ``nbddp.batch()``'s keywords,
    ``to_argv`` and the documentation's table (docs/reference/options.md, written by docs/hooks.py) all have it (exactly where its declaration says), so a new option is
    one new field of ``LaunchOptions``."""
    import inspect

    import nbddp
    from nbddp.plan.option_fields import declared, fields_of, takes
    from nbddp.plan.options import BATCH, DOORS, RUN, LaunchOptions, options_table

    parsers = _door_parsers()
    table = options_table()
    assert set(parsers) == set(DOORS)
    everything = list(declared(LaunchOptions))
    assert {d.name for d in everything if d.parent is None} == {f.name for f in fields(LaunchOptions)}
    for declaration in everything:
        option = declaration.option
        for door, (parser, prefix) in parsers.items():
            if option.flags:
                assert (option.flags[0] in _flags(parser, prefix)) == takes(declaration, door), (declaration.name, door)
            if not takes(declaration, door) or not option.flags:
                continue
            argv = _example(declaration)
            parsed = launch_options(parser.parse_args([*prefix, *argv]))
            assert parsed != LaunchOptions(), (argv, door)  # the example is a value of its own
            assert parse(parsed.to_argv()) == parsed, argv  # to_argv says it, and it parses back
            assert option.flags[-1 if option.render is None else 0] in parsed.to_argv(), argv
        if option.flags:
            assert f"`{declaration.keyword()}`" in table and f"| `{option.flags[0]}" in table, declaration.name
    for function, door in ((nbddp.run, RUN), (nbddp.batch, BATCH)):
        keywords = inspect.signature(function).parameters
        for top in fields_of(LaunchOptions):
            assert (top.name in keywords) == takes(top, door), (top.name, door)
            assert (f"    {top.name}: " in function.__doc__) == takes(top, door)


def test_python_values_become_what_the_command_line_gives():
    """``nbddp.run(gpus=2, returns="a,b", run_dir="x")`` builds the options ``--gpus 2 --return a,b --run-dir x`` do."""
    from pathlib import Path

    given = LaunchOptions(gpus=2, returns="a,b", run_dir="x", parameters=None, collective_timeout=0)
    assert given == parse(["--gpus", "2", "--return", "a,b", "--run-dir", "x", "--collective-timeout", "0"])
    assert given.gpus == "2" and given.run_dir == Path("x") and given.parameters == {} and given.collective_timeout is None
    with pytest.raises(UsageError, match="--engine jax: choose one of torch, catalyst"):
        LaunchOptions(engine="jax")  # (argparse's choices on the command line: the same declaration)


def test_an_unknown_keyword_of_nbddp_run_is_pythons_type_error_naming_the_nearest():
    import nbddp

    with pytest.raises(TypeError, match=r"run\(\) got an unexpected keyword argument 'gpu' \(did you mean 'gpus'\?\)"):
        nbddp.run("nb.ipynb", gpu=1)
    with pytest.raises(TypeError, match="missing a required argument: 'grid'"):
        nbddp.batch("nb.ipynb")
    with pytest.raises(UsageError, match="--nproc 0: need at least 1 process"):
        nbddp.run("nb.ipynb", nproc=0)  # refused before anything reads the notebook


def test_more_cpu_processes_than_the_machine_can_hold_need_oversubscribe():
    most = CPUS * PROCESSES_PER_CPU
    with pytest.raises(UsageError, match=f"at most {most} processes .*--nproc {most} or fewer, or add --oversubscribe"):
        parse(["--cpu", "--nproc", str(most + 1)])
    assert parse(["--cpu", "--nproc", str(most)]).nproc == most
    assert parse(["--cpu", "--nproc", str(most + 1), "--oversubscribe"]).oversubscribe
    assert parse(["--nproc", "10000", "--slurm"]).nproc == 10000  # a cluster's nodes are not this machine


def test_the_log_cap_reads_sizes_as_the_ending_line_says_them():
    assert LaunchOptions().log_cap == 100_000_000
    assert [parse(["--log-cap", size]).log_cap for size in ("2GB", "1.5 MB", "500kB", "12345", "0")] == \
        [2_000_000_000, 1_500_000, 500_000, 12345, None]
    assert parse(LaunchOptions(log_cap="2GB").to_argv()) == LaunchOptions(log_cap=2_000_000_000)


def test_a_batchs_own_options_are_declared_once_for_its_command_and_its_function():
    """``--gpus-per-run``, ``--parallel``, ``--out``, ``--resume``, ``--fresh``: declared in ``SweepOptions``
    (plan/options.py), from which ``nbddp batch``'s parser and ``nbddp.batch()``'s keywords are both made, so their
    help and defaults can't differ; a bad value is the same one line from either."""
    import inspect

    import nbddp
    from nbddp.doors.cli import _commands, build_parser
    from nbddp.plan.option_fields import fields_of, values_from
    from nbddp.plan.options import SLURM_PARALLEL, SweepOptions

    parser = _commands(build_parser())["batch"]
    shown = " ".join(parser.format_help().split())
    keywords = inspect.signature(nbddp.batch).parameters
    for top in fields_of(SweepOptions):
        assert f"{top.option.flags[0]} " in shown and " ".join(top.option.help.split()) in shown, top.name
        assert keywords[top.name].default == top.default == getattr(SweepOptions(), top.name), top.name
        assert f"    {top.name}: {top.option.flags[0]}" in nbddp.batch.__doc__
    assert f"--slurm default {SLURM_PARALLEL}" in shown  # (the help says the default the schedule uses)
    given = values_from(SweepOptions, parser.parse_args(["nb.ipynb", "--grid", "g.yaml", "--parallel", "3", "--fresh"]))
    assert SweepOptions(**given) == SweepOptions(parallel=3, fresh=True)
    with pytest.raises(UsageError, match=r"^--parallel 0: need at least 1\.$"):
        SweepOptions(**values_from(SweepOptions, parser.parse_args(["nb.ipynb", "--grid", "g.yaml", "--parallel", "0"])))
    with pytest.raises(UsageError, match=r"^--gpus-per-run 0: need at least 1\.$"):
        nbddp.batch("nb.ipynb", {"lr": [1]}, gpus_per_run=0)
