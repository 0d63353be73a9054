"""A rank forked from a starter that imported torch is what a fresh ``python -u PROGRAM`` is, where the program
can tell: the same observations, the same exits (real forks and real interpreters, side by side)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from nbddp.contracts.interpreter import code_argv, program_argv
from nbddp.launchers import forked_rank

pytestmark = pytest.mark.skipif(not forked_rank.FORKS, reason="ranks are forked on Linux only")

#: What a program can see of how it was started. Run as a script and as ``-m probe``; ``MODE`` picks an ending.
PROBE = textwrap.dedent('''
    import atexit, json, os, random, signal, sys, threading, time

    def observe():
        import numpy, torch
        fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
        return {
            "argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0],
            "loader": type(__loader__).__name__, "spec": repr(__spec__) if __spec__ is None else __spec__.name,
            "main": sys.modules["__main__"].__dict__ is globals(),
            "session_leader": os.getsid(0) == os.getpid(), "stdin": os.readlink("/proc/self/fd/0"),
            "fds": fds[:3], "more_fds": len(fds) > 4,  # (listdir's own is the fourth)
            "signals": {name: str(signal.getsignal(getattr(signal, name)))
                        for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGCHLD", "SIGPIPE", "SIGUSR1")},
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "only_here": os.environ.get("ONLY_HERE"), "rank": os.environ.get("RANK"),
            "stdout": [type(sys.stdout.buffer).__name__, sys.stdout.write_through, sys.stdout.encoding],
            "stderr": [type(sys.stderr.buffer).__name__, sys.stderr.write_through],
            "threads": torch.get_num_threads(), "tasks": len(os.listdir("/proc/self/task")),
            "random": random.random(), "numpy": float(numpy.random.rand()),
            "annotations": repr(typed.__annotations__), "builtins": type(__builtins__).__name__,
        }

    def typed(x: int) -> "list":  # no __future__ import: evaluated, as in a fresh interpreter
        return [x]

    mode = os.environ.get("MODE", "observe")
    if mode == "observe":
        with open(os.environ["OUT"], "w") as out:
            json.dump(observe(), out)
    elif mode == "exit":
        sys.exit(int(os.environ["CODE"]))
    elif mode == "message":
        sys.exit("a message for stderr")
    elif mode == "raise":
        def deep():
            raise ValueError("raised in the program")
        deep()
    elif mode == "ctrl-c":
        raise KeyboardInterrupt
    elif mode == "threads":  # a non-daemon thread is joined, then atexit runs, then the streams are flushed
        atexit.register(lambda: print("atexit ran", flush=False))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
''')

#: Forks each case's rank from one process that imported torch, as the starter does, and reports the exit codes.
DRIVER = textwrap.dedent('''
    import json, os, sys, time
    from nbddp.launchers import forked_rank
    cases = json.loads(sys.argv[1])
    forked_rank.preload("1")
    os.environ["ONLY_HERE"] = "the starter's"  # set after the preload: a rank sees only its own environment
    ranks = []
    for program, env in cases:  # one case's output at a time: each case's rank ends before the next starts
        ranks.append(forked_rank.start(program, env))
        while ranks[-1].poll() is None:  # (the driver's own wait: subprocess.run's timeout bounds it)
            time.sleep(0.02)
    print("CODES", json.dumps([rank.returncode for rank in ranks]))
''')


def _env(tmp_path, **extra):
    """The probe's folder first on the module path (``-m probe``: nbddp's interpreters never put their working folder
    there, tests/test_safe_path.py), then this interpreter's."""
    env = {key: value for key, value in os.environ.items() if key != "ONLY_HERE"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.slow
def test_a_forked_rank_sees_what_a_fresh_interpreter_sees_and_ends_as_one_does(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "sub").mkdir()
    script = str(tmp_path / "probe.py")
    observe = [(["probe.py", "--lr", "0.1"], "script"), (["-m", "probe", "--lr", "0.1"], "module")]
    cases = [(program, _env(tmp_path, OUT=str(tmp_path / f"forked-{kind}-{rank}.json"), RANK=str(rank)))
             for program, kind in observe for rank in (0, 1)]
    endings = [("exit", {"CODE": "3"}), ("message", {}), ("raise", {}), ("ctrl-c", {}), ("threads", {})]
    cases += [(["probe.py"], _env(tmp_path, MODE=mode, **extra)) for mode, extra in endings]
    # (the starter as nbddp starts it, and each fresh rank as nbddp would: nbddp.contracts.interpreter)
    driver = subprocess.run(code_argv(DRIVER, json.dumps(cases)), cwd=tmp_path, capture_output=True, env=_env(tmp_path),
                            text=True, timeout=120, stdin=subprocess.DEVNULL)  # (its module path: the ranks' too)
    assert driver.returncode == 0, driver.stderr
    codes = json.loads(driver.stdout.rpartition("CODES ")[2])

    fresh = {}
    for program, kind in observe:
        out = tmp_path / f"fresh-{kind}.json"
        subprocess.run(program_argv(program, flags=("-u",)), cwd=tmp_path, env=_env(tmp_path, OUT=str(out), RANK="0"),
                       stdin=subprocess.DEVNULL, start_new_session=True, timeout=120, check=True)
        fresh[kind] = json.loads(out.read_text())
    for program, kind in observe:
        seen = [json.loads((tmp_path / f"forked-{kind}-{rank}.json").read_text()) for rank in (0, 1)]
        assert seen[0]["random"] != seen[1]["random"] and seen[0]["numpy"] != seen[1]["numpy"], \
            "each forked rank seeds its own generators, as a fresh interpreter does"
        assert seen[1]["rank"] == "1"
        for key in ("random", "numpy", "rank"):
            for observed in (*seen, fresh[kind]):
                del observed[key]
        assert seen[0] == fresh[kind], kind
    assert fresh["script"]["path0"] == str(tmp_path) and fresh["module"]["argv"][0] == script  # (what was compared)
    assert fresh["script"]["only_here"] is None and fresh["script"]["threads"] == 1

    fresh_codes = [subprocess.run(program_argv(program, flags=("-u",)), cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=120).returncode for program, env in cases[4:]]
    assert codes[4:] == fresh_codes == [3, 1, 1, -signal.SIGINT, 0]
    assert codes[:4] == [0, 0, 0, 0]
    output = driver.stdout + driver.stderr
    assert "a message for stderr" in driver.stderr
    raised = driver.stderr[driver.stderr.index("Traceback"):driver.stderr.index("ValueError: raised in the program")]
    assert "forked_rank" not in raised and f'File "{script}"' in raised.replace("probe.py", script), \
        "the traceback starts at the program's frame, as a fresh interpreter's does"
    assert output.index("thread finished") < output.index("atexit ran")
