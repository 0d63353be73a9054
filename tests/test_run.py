"""``nbddp run`` with real processes: 2 ranks, gloo, a real kernel, checked by PID.

The runs ask for CPU ranks (``--cpu``: 2 gloo processes, on a machine with GPUs too); the examples'
test runs with this machine's default devices and checks what they are."""

import json
import re
import shutil
import signal
import stat
import time

import nbformat
import pytest
import torch

from nbddp.contracts.atomic import ordinary_mode
from nbddp.contracts.devices import resolve, visible_gpu_count
from tests.conftest import EXAMPLES, code, md, wait_until, write_notebook

pytestmark = pytest.mark.slow

SETUP = """#| ddp
import time
import torch
import nbddp

#: (nbddp run's kernels run beside their job and prepare no warm ranks: tested here as users get them, conftest.py.)
PREPARES_AHEAD = True
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)"""

EVALUATE = "print('kernel sees weight sum', round(float(model.weight.sum()), 6))"


def run_dirs(folder):
    return sorted((folder / "runs").iterdir())


def result_of(run_dir):
    return json.loads((run_dir / "result.json").read_text())


def cell_texts(path):
    nb = nbformat.read(path, as_version=4)
    return ["".join(o.get("text", "") for o in c.get("outputs", []) if o.output_type == "stream") for c in nb.cells]


@pytest.mark.parametrize("name, epochs, minimum", [
    ("digits_torch", 6, 0.9)])  # (digits_catalyst.ipynb's accuracy: tests/test_nodes.py, across two nodes)
def test_examples_end_to_end_with_cpu_evaluation(tmp_path, cli_run, name, epochs, minimum):
    """With no device flag: 2 CPU processes (gloo) where no GPU is visible, and it says so; every GPU where
    there are some. Either way the kernel evaluates the returned weights on the CPU."""
    devices = resolve()  # what this machine gives a run that names no devices
    last = devices.nproc - 1
    shutil.copy(EXAMPLES / f"{name}.ipynb", tmp_path)
    run = cli_run(["run", f"{name}.ipynb", "-p", "epochs", epochs], tmp_path)
    assert run.wait() == 0, run.output
    if devices.kind == "cpu":
        assert devices.nproc == 2 and "no GPU visible: running on the CPU with 2 processes (gloo)." in run.output
    assert "[rank 0]" in run.output and f"[rank {last}]" in run.output
    accuracy = float(re.search(r"\[cell \d+\] test accuracy: ([\d.]+)", run.output).group(1))
    assert accuracy > minimum
    (run_dir,) = run_dirs(tmp_path)
    for part in ("train.py", "train.py.map.json", "logs/rank-0.log", f"logs/rank-{last}.log", "logs/launcher.log",
                 "weights.pt", "metrics.jsonl", "result.json", "output.ipynb"):
        assert (run_dir / part).exists(), part
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
    result = result_of(run_dir)
    assert result["status"] == "succeeded" and result["exit_code"] == 0
    assert result["world_size"] == devices.nproc and result["devices"] == {"kind": devices.kind, "nproc": devices.nproc}
    assert result["rank_exit_codes"] == {str(r): 0 for r in range(devices.nproc)}
    assert result["overrides"] == {"epochs": epochs}
    assert result["parameters"]["epochs"] == epochs and len(result["parameters"]) > 1  # the defaults too
    assert result["command"] == f"nbddp run {name}.ipynb -p epochs {epochs}"
    assert set(result["versions"]) == {"nbddp", "torch", "python"} and result["notebook"].endswith(f"{name}.ipynb")
    assert result["final_metrics"]["epoch"] == epochs
    assert result["wall_time_s"] > 0 and result["ended_at"] > result["started_at"]
    texts = cell_texts(run_dir / "output.ipynb")
    assert any(f"[rank {last}]" in t and "loaded the trained model" in t for t in texts)
    assert f"test accuracy: {accuracy:.3f}" in texts[-1]
    assert not run.leftovers()


def test_ddp_matches_one_process_with_double_batch(tmp_path, cli_run):
    """2 ranks x batch 8, plain SGD, no shuffle == 1 process x batch 16 (DDP averages gradients)."""
    data = "X = torch.linspace(-1, 1, 64 * 4).reshape(64, 4)\nY = (X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])).squeeze(1)"
    train = (
        "#| ddp-train\n"
        "ddp_model = nbddp.prepare(model)\n"
        "loader = nbddp.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8))\n"
        "opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05)\n"
        "for epoch in range(3):\n"
        "    for x, y in loader:\n"
        "        opt.zero_grad()\n"
        "        ((ddp_model(x).squeeze(1) - y) ** 2).mean().backward()\n"
        "        opt.step()"
    )
    setup = "#| ddp\nimport torch, nbddp\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\n" + data
    write_notebook(tmp_path / "eq.ipynb", [code(setup), code(train)])
    (tmp_path / "tmp").mkdir()
    run = cli_run(["run", "eq.ipynb", "--cpu", "--nproc", "2"], tmp_path, env={"TMPDIR": str(tmp_path / "tmp")})
    assert run.wait() == 0, run.output
    assert "without encryption" not in run.output  # ipykernel's warning for TCP: the local kernel uses IPC
    assert not list((tmp_path / "tmp").iterdir())  # not even torch's empty torchinductor_<user> (DDP makes it)
    trained = torch.load(run_dirs(tmp_path)[0] / "weights.pt", weights_only=True)["returns"]["model"]

    namespace = {}
    exec(setup.replace("#| ddp\n", ""), namespace)
    model, X, Y = namespace["model"], namespace["X"], namespace["Y"]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        for x, y in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16):
            opt.zero_grad()
            ((model(x).squeeze(1) - y) ** 2).mean().backward()
            opt.step()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6)


def test_parameters_reach_kernel_and_every_rank_and_cwd_is_the_notebooks(tmp_path, cli_run):
    (tmp_path / "data.txt").write_text("relative file ok")
    value = "it's \"q\"\\ é\nline2"
    write_notebook(tmp_path / "p.ipynb", [
        code("tag = 'default'\nsteps = 1\nscale = 0.5", "parameters"),
        code("%load_ext nbddp\n%ddp_ranks"),  # (a kernel beside a job prepares no warm ranks: the job's are its own)
        code(SETUP + "\ncontent = open('data.txt').read()"),
        code("#| ddp-train\nprint(f'rank {nbddp.rank()} tag={tag!r} steps={steps} content={content}')\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nloader = torch.utils.data.DataLoader(range(4))"),
        code("print(f'kernel tag={tag!r} steps={steps} scale={scale!r} opt lr={opt[\"param_groups\"][0][\"lr\"]}')"),
    ])
    run = cli_run(["run", "p.ipynb", "--cpu", "-p", "tag", value, "-p", "steps", "3", "-p", "scale", "'0.5x'",
                   "--return", "model,opt,loader"], tmp_path)
    assert run.wait() == 0, run.output
    # what only a training cell made comes back as saved; what isn't weights is left out, said, and costs nothing else
    assert ("[nbddp] loaded the trained model, opt (as saved: the kernel had no opt to load it into) on the CPU from "
            "weights.pt (loader (a DataLoader) didn't come back: only modules, optimizers, tensors and plain values") \
        in run.output, run.output
    assert "opt lr=0.1" in run.output
    assert run.output.count("warning: parameter") == 1, run.output  # text meant for a number: said before the run
    assert ("nbddp: warning: parameter scale = '0.5x' is text, but the notebook's default 0.5 is a number: the cells "
            "get '0.5x' as it is.") in run.output
    assert "kernel tag=" in run.output and "scale='0.5x'" in run.output
    assert "[nbddp] no warm ranks" in run.output and "preparing warm ranks" not in run.output, run.output
    (run_dir,) = (tmp_path / "runs").iterdir()  # every file one mode, the umask's; the folder the user's alone
    modes = {str(f.relative_to(run_dir)): oct(stat.S_IMODE(f.stat().st_mode)) for f in run_dir.rglob("*") if f.is_file()}
    assert {"output.ipynb", "result.json", "weights.pt", "logs/rank-0.log", "logs/launcher.log"} <= set(modes), modes
    assert set(modes.values()) == {oct(ordinary_mode())} and stat.S_IMODE(run_dir.stat().st_mode) == 0o700, modes
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} tag={value!r} steps=3 content=relative file ok" in run.output
    assert f"kernel tag={value!r} steps=3" in run.output


def test_rank_raising_names_cell_line_rank_and_stops_everything(tmp_path, cli_run):
    write_notebook(tmp_path / "boom.ipynb", [
        md("# a markdown cell counts too"),
        code(SETUP),
        code(
            "#| ddp-train\n"
            "model = nbddp.prepare(model)\n"
            "for step in range(1000):\n"
            "    if step == 3 and nbddp.rank() == 1:\n"
            "        raise ValueError('bad batch at step 3')\n"
            "    torch.distributed.barrier()\n"
            "    time.sleep(0.05)"
        ),
        code("print('EVALUATION RAN')"),
    ])
    started = time.monotonic()
    run = cli_run(["run", "boom.ipynb", "--cpu"], tmp_path)
    assert run.wait() == 1, run.output
    assert time.monotonic() - started < 90
    assert "rank 1 raised ValueError: bad batch at step 3" in run.output
    assert "boom.ipynb, cell 3, line 5" in run.output
    assert "raise ValueError('bad batch at step 3')" in run.output
    assert "EVALUATION RAN" not in run.output
    (run_dir,) = run_dirs(tmp_path)
    result = result_of(run_dir)
    assert result["status"] == "failed" and result["rank_exit_codes"]["1"] == 1
    nb = nbformat.read(run_dir / "output.ipynb", as_version=4)
    errors = [o for o in nb.cells[2].outputs if o.output_type == "error"]
    # The kernel raises the run's judged error in the training cell's place: RunFailed (as %%ddp_train raises,
    # and as papermill reports it), naming the rank's exception, cell and line.
    assert errors and errors[0].ename == "RunFailed" and "rank 1 raised ValueError" in errors[0].evalue
    assert "cell 3, line 5" in "\n".join(errors[0].traceback)
    assert nb.cells[3].outputs == []
    assert not run.leftovers()


def test_a_kernel_cell_failing_after_training_raises_with_its_cell_and_line(tmp_path):
    """``nbddp.run()``: an evaluation cell's assertion is a RunFailed that names, and carries, its cell and line
    (cell 5: the markdown cell counts, the injected parameters cell doesn't), pickled too, and result.json
    records them."""
    import pickle

    import nbddp
    from nbddp.contracts.errors import RunFailed

    write_notebook(tmp_path / "regress.ipynb", [
        code("threshold = 0.5", "parameters"), md("# training"), code(SETUP),
        code("#| ddp-train\nmodel = nbddp.prepare(model)"),
        code("acc = 39.61\ncond = True\nassert acc > threshold, (cond, acc)\nprint('EVALUATION PASSED')")])
    result = nbddp.run(tmp_path / "regress.ipynb", cpu=True, nproc=2, parameters={"threshold": 50}, quiet=True)
    with pytest.raises(RunFailed) as raised:
        result.raise_for_status()
    error = pickle.loads(pickle.dumps(raised.value))
    assert (error.rank, error.exc_type, error.exc_message, error.cell, error.line) == (
        None, "AssertionError", "(True, 39.61)", 5, 3)
    assert "regress.ipynb: cell 5, line 3 raised in the kernel:\nAssertionError: (True, 39.61)" in str(error)
    assert error.run_dir == str(result.run_dir)
    recorded = result_of(result.run_dir)
    assert recorded["failure"] == {"rank": None, "exc_type": "AssertionError", "exc_message": "(True, 39.61)",
                                   "cell": 5, "line": 3}
    assert recorded["status"] == "failed" and recorded["error"] == str(error)


LONG_TRAINING = [code(SETUP), code("#| ddp-train\nfor step in range(100000):\n    print('step', step, flush=True)\n    time.sleep(0.1)"), code("print('EVALUATION RAN')")]


@pytest.mark.parametrize("sig, expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signal_during_training_stops_every_process(tmp_path, cli_run, sig, expected):
    write_notebook(tmp_path / "long.ipynb", LONG_TRAINING)
    run = cli_run(["run", "long.ipynb", "--cpu"], tmp_path)
    run.wait_for("[rank 1] step 3")
    run.proc.send_signal(sig)
    sent = time.monotonic()
    assert run.wait(timeout=30) == expected, run.output
    assert time.monotonic() - sent < 10
    assert not run.leftovers(grace=1)
    result = result_of(run_dirs(tmp_path)[0])
    assert result["status"] == "interrupted" and result["exit_code"] == expected


@pytest.mark.waits  # mostly a timeout or a mid-training signal: runs beside the rest in .ci/run
def test_timeout_stops_the_run_with_124(tmp_path, cli_run):
    write_notebook(tmp_path / "long.ipynb", LONG_TRAINING)
    run = cli_run(["run", "long.ipynb", "--cpu", "--timeout", "12"], tmp_path)
    assert run.wait(timeout=60) == 124, run.output
    assert "EVALUATION RAN" not in run.output
    assert result_of(run_dirs(tmp_path)[0])["status"] == "timeout"
    assert not run.leftovers()


def test_two_concurrent_runs_in_one_folder(tmp_path, cli_run):
    write_notebook(tmp_path / "nb.ipynb", [code(SETUP), code("#| ddp-train\nmodel = nbddp.prepare(model)\nprint('rank', nbddp.rank(), 'trained')"), code(EVALUATE)])
    runs = [cli_run(["run", "nb.ipynb", "--cpu"], tmp_path) for _ in range(2)]
    assert [r.wait() for r in runs] == [0, 0], [r.output for r in runs]
    dirs = run_dirs(tmp_path)
    assert len(dirs) == 2 and all(result_of(d)["status"] == "succeeded" for d in dirs)
    for run in runs:
        assert not run.leftovers()


def test_more_gpus_than_visible_is_an_error_before_anything_starts(tmp_path, cli_run):
    visible = visible_gpu_count()  # 0 on a machine without GPUs
    write_notebook(tmp_path / "nb.ipynb", [code(SETUP), code("#| ddp-train\npass")])
    run = cli_run(["run", "nb.ipynb", "--gpus", str(visible + 4)], tmp_path)
    assert run.wait() == 3
    assert f"--gpus {visible + 4} asks for more GPUs than the {visible} visible" in run.output
    assert not (tmp_path / "runs").exists()


def test_floods_bad_bytes_and_progress_bars_neither_block_nor_get_lost(tmp_path, cli_run):
    write_notebook(tmp_path / "noisy.ipynb", [code(SETUP), code(
        "#| ddp-train\n"
        "import sys\n"
        "for i in range(100000):\n"
        "    print(f'line {i} ' + 'x' * 40)\n"
        "sys.stdout.flush()\n"
        "sys.stdout.buffer.write(b'bad bytes \\xff\\xfe end\\n')\n"
        "for p in range(0, 101, 10):\n"
        "    sys.stderr.write(f'\\rprogress {p}%')\n"
        "sys.stderr.write('\\n')\n"
        "print('DONE', nbddp.rank())"
    ), code(EVALUATE)])
    run = cli_run(["run", "noisy.ipynb", "--cpu"], tmp_path)
    assert run.wait() == 0, run.output[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_bytes()
        assert log.count(b"\nline ") == 100000  # nothing dropped (the first line is the rank banner)
        assert b"bad bytes \xff\xfe end" in log
        assert f"[rank {rank}] DONE {rank}" in run.output
    assert "[rank 0] bad bytes \ufffd\ufffd end" in run.output
    assert "[rank 1] progress 100%" in run.output
    nb = nbformat.read(run_dir / "output.ipynb", as_version=4)
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "more lines not shown: full logs in" in text and len(text) < 500_000


def test_torchs_warning_written_over_a_progress_bar_is_one_line_for_all_ranks(tmp_path, cli_run):
    """DDP's C++ warning, printed by each rank while tqdm's bar holds its line, is shown once, without torch's prefix."""
    write_notebook(tmp_path / "warned.ipynb", [code(SETUP + "\nfrom tqdm import tqdm"), code(
        "#| ddp-train\n"
        "ddp_model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)\n"
        "for step in tqdm(range(3)):\n"
        "    ddp_model(torch.randn(4, 4)).sum().backward()\n"
        "print('DONE', nbddp.rank())"
    )])
    run = cli_run(["run", "warned.ipynb", "--cpu"], tmp_path)
    assert run.wait() == 0, run.output[-3000:]
    warnings = [line for line in run.output.splitlines() if "find_unused_parameters=True was specified" in line]
    assert len(warnings) == 1 and warnings[0].startswith("[all ranks] [W"), run.output
    assert "[rank0]:" not in run.output and "[rank1]:" not in run.output


CATALYST_SLOW = [
    code(
        "#| ddp\nimport time\nimport torch\nfrom torch.utils.data import DataLoader, TensorDataset\nfrom catalyst import dl\n"
        "X, y = torch.randn(64, 4), torch.randint(0, 2, (64,))\n"
        "loaders = {'train': DataLoader(TensorDataset(X, y), batch_size=8)}\n"
        "model = torch.nn.Linear(4, 2)\n"
        "class Slow(dl.Callback):\n"
        "    def __init__(self):\n"
        "        super().__init__(order=dl.CallbackOrder.External)\n"
        "    def on_batch_end(self, runner):\n"
        "        print('batch', runner.engine.process_index, runner.batch_step, flush=True)\n"
        "        time.sleep(0.1)"
    ),
    code(
        "#| ddp-train\nrunner = dl.SupervisedRunner()\n"
        "runner.train(model=model, criterion=torch.nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),\n"
        "             loaders=loaders, num_epochs=1000, callbacks=[Slow()], verbose=False)"
    ),
    code("print('EVALUATION RAN')"),
]


def test_interrupted_catalyst_run_is_never_a_success(tmp_path, cli_run):
    write_notebook(tmp_path / "cat.ipynb", CATALYST_SLOW)
    run = cli_run(["run", "cat.ipynb", "--cpu"], tmp_path)
    run.wait_for("[rank 1] batch 1")
    run.proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert run.wait(timeout=30) == 130, run.output
    assert time.monotonic() - sent < 10
    assert "EVALUATION RAN" not in run.output
    assert result_of(run_dirs(tmp_path)[0])["status"] == "interrupted"
    assert not run.leftovers(grace=1)


def test_sigkilled_run_keeps_an_executed_notebook_of_the_cells_that_ran(tmp_path, cli_run):
    """The executed notebook is saved after every cell (as papermill does), so even SIGKILL keeps it."""
    write_notebook(tmp_path / "k.ipynb", [
        code("lr = 0.1", "parameters"), code("print('EXPLORED', lr)"), code(SETUP),
        code("#| ddp-train\nfor step in range(10000):\n    print('step', step, flush=True)\n    time.sleep(0.1)"),
        code(EVALUATE),
    ])
    run = cli_run(["run", "k.ipynb", "--cpu", "-p", "lr", "0.5"], tmp_path)
    run.wait_for("[rank 1] step 3")
    wait_until(lambda: "training as a DDP job" in _texts_so_far(tmp_path), 60,  # (the ranks may train before
               "the kernel reached the training cell (its saved notebook)")  # the kernel has reached that cell)
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait(10)
    assert not run.leftovers(grace=10)
    _remove_the_killed_kernels_sockets()
    (run_dir,) = run_dirs(tmp_path)
    texts = cell_texts(run_dir / "output.ipynb")
    assert "EXPLORED 0.5" in texts[2]  # the injected parameters cell sits at index 1
    assert "training as a DDP job" in texts[4] and "kernel sees" not in "".join(texts)
    assert not list(run_dir.glob(".*partial"))


def _texts_so_far(folder) -> str:
    try:
        return "".join(cell_texts(next((folder / "runs").glob("*/output.ipynb"))))
    except (StopIteration, OSError, ValueError):
        return ""


def _remove_the_killed_kernels_sockets() -> None:
    """A SIGKILLed ``nbddp run`` can't remove its kernel's socket folder; the next run does (as here)."""
    import os

    from nbddp.doors.notebook_kernel import SOCKETS_PREFIX
    from nbddp.contracts.process_groups import owned_temp_dir

    os.rmdir(owned_temp_dir(SOCKETS_PREFIX, for_sockets=True))


def test_training_code_that_destroys_the_group_itself_succeeds(tmp_path, cli_run):
    """Scripts ported to notebooks end with barrier + destroy_process_group: the run still succeeds,
    the weights come back, and every rank exits 0 (the guarded destroy keeps its barrier until exit)."""
    write_notebook(tmp_path / "d.ipynb", [code(SETUP), code(
        "#| ddp-train\nimport torch.distributed as dist\nddp = nbddp.prepare(model)\n"
        "ddp(torch.randn(8, 4)).sum().backward()\ndist.barrier()\ndist.destroy_process_group()"), code(EVALUATE)])
    run = cli_run(["run", "d.ipynb", "--cpu"], tmp_path)
    assert run.wait() == 0, run.output
    assert "kernel sees weight sum" in run.output
    (run_dir,) = run_dirs(tmp_path)
    assert result_of(run_dir)["rank_exit_codes"] == {"0": 0, "1": 0}
    assert not run.leftovers()
