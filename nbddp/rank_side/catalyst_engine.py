"""Catalyst glue that runs in the script's process and in the ranks Catalyst spawns.

Catalyst 22.4 is the last release and was written for older torch/accelerate,
so three incompatibilities are handled here, deliberately and in one place:

* On CPU its DDP engine must be built with ``cpu=True`` and the gloo backend,
  or every rank believes it is the main process and they race on the logdir.
* Its default port 2112 collides between concurrent runs: a free port is used.
* Its ``mp.spawn`` children exit 0 on SIGINT (torch's spawn wrapper swallows
  ``KeyboardInterrupt``), so an interrupted rank here exits 130 instead.
* accelerate renamed ``DistributedType.TPU`` to ``XLA``; Catalyst's engine and
  metric callbacks still read ``TPU``, which crashes outside DDP. The alias is
  restored (:func:`~nbddp.rank_side.catalyst_compat.apply_catalyst_shims`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from catalyst import dl
from catalyst.core.callback import Callback, CallbackOrder

from nbddp.contracts.ports import free_port
from nbddp.contracts.rundir import SCRIPT_NAME
from nbddp.rank_side import process as rank_process
from nbddp.rank_side import torch_engine as runtime
from nbddp.contracts.status import Status
from nbddp.contracts.rank_env import DEFAULT_RDZV_TIMEOUT, RankEnv
from nbddp.rank_side.catalyst_compat import apply_catalyst_shims
from nbddp.rank_side.parent_death import launching_ranks
from nbddp.contracts.errors import see

if TYPE_CHECKING:
    from catalyst.core.runner import IRunner
    from catalyst.runners.runner import Runner

_state = {"trained": False, "patched": False}


def requested_processes() -> tuple[int, bool]:
    """``(world size, cpu)`` from the launcher's environment, else from the hardware."""
    import torch

    env = RankEnv.from_environ()
    cpu = env.device == "cpu" or not torch.cuda.is_available()
    return env.nproc or (2 if cpu else torch.cuda.device_count()), cpu


#: What torchrun sets in each process it starts (its agent's run id).
TORCHRUN_VARIABLE = "TORCHELASTIC_RUN_ID"


def _by_hand(nproc: str) -> str:
    """How this script is started by hand with ``nproc`` ranks (a placeholder): ``NBDDP_NPROC=N python train.py``."""
    return f"{RankEnv.shell(nproc=nproc)} python {os.path.basename(sys.argv[0]) or SCRIPT_NAME}"


def start() -> None:
    """Called by the catalyst engine's script at import time (and so in every spawned rank).

    Under torchrun each of its N processes would spawn N ranks of its own (N×N, each group training alone): the
    script refuses at once, in one line, saying how it is started instead."""
    if TORCHRUN_VARIABLE in os.environ:
        print(f"nbddp: this script runs on Catalyst's DDP engine, which starts one rank per device itself: under "
              f"torchrun each of its processes would start as many. Run it with python ({_by_hand('N')}; nbddp run "
              f"starts it so).", file=sys.stderr, flush=True)
        raise SystemExit(2)
    rank_process.use_notebook_folder()
    apply_catalyst_shims()


def use_ddp(returns: Sequence[str] = ("model",)) -> None:
    """Make every Catalyst ``Runner.train`` below run on Catalyst's DDP engine; its trained model
    comes back under the first name of ``returns``."""
    patch_runner_train(tuple(returns))


def finish(namespace: dict[str, Any], returns: Sequence[str]) -> None:
    """End of the training block: nothing to do once rank 0 of the spawned ranks saved the model."""
    if trained():
        return
    runtime.finish(namespace, returns, mark=False)  # runner.train never ran: save like the torch engine


#: The longest temp folder path under which multiprocessing's sockets (``pymp-XXXXXXXX/listener-XXXXXXXX``)
#: still fit in a Unix socket's 107 bytes.
SOCKET_TEMP_ROOM = 70


def _temp_dir_that_holds_sockets() -> None:
    """torch.multiprocessing hands every tensor to Catalyst's spawned ranks through a Unix socket in
    multiprocessing's temp folder, and a socket's path holds at most 107 bytes: under a long ``TMPDIR``
    (JupyterHub's, a batch system's, a test's) pickling the loaders failed with "AF_UNIX path too long".
    There, this launching process's temp folder is a private one in /tmp, removed when it exits."""
    if len(tempfile.gettempdir()) <= SOCKET_TEMP_ROOM or not os.access("/tmp", os.W_OK | os.X_OK):
        return
    short = tempfile.mkdtemp(prefix=f"nbddp-catalyst-{os.getpid()}-", dir="/tmp")
    atexit.register(shutil.rmtree, short, True)
    tempfile.tempdir = short


def trained() -> bool:
    """True once a patched ``runner.train`` finished in this (launching) process."""
    return _state["trained"]


class NbddpDistributedDataParallelEngine(dl.DistributedDataParallelEngine):
    """Catalyst's DDP engine, spawning through :func:`_rank_main` (per-rank logs, exit codes)."""

    def spawn(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        import torch.multiprocessing as mp

        _temp_dir_that_holds_sockets()
        check_picklable(fn)
        launching_ranks()
        return mp.spawn(_rank_main, args=(fn, self._world_size, self._workers_global_rank),
                        nprocs=self._num_local_workers, join=True)

    def setup(self, local_rank: int, world_size: int) -> None:
        """Catalyst's setup, on GPUs with the rank's own GPU checked, made current and bound to the NCCL
        group (as the torch engine's ranks); on one machine, the ranks meet in the run's store folder
        (:mod:`nbddp.launchers.private_rendezvous`) rather than at Catalyst's TCP address; across nodes, joining waits
        at most ``--rdzv-timeout`` (then the collective timeout applies) and the nodes check they run the same
        script."""
        if self._process_group_kwargs.get("backend", "nccl") == "nccl":  # (Catalyst's default: GPUs)
            gpu = self._own_gpu(local_rank)
            torch.cuda.set_device(gpu)
            self._process_group_kwargs = {**runtime.group_backend(True, gpu), **self._process_group_kwargs}
        env = RankEnv.from_environ()
        if not env.nnodes or env.nnodes < 2:
            if env.store is not None:  # one machine: meet in a file of the run's private folder, not a TCPStore
                self._process_group_kwargs = {**self._process_group_kwargs, "init_method": f"file://{env.store}/catalyst",
                                              "rank": self._workers_global_rank + local_rank}
            return super().setup(local_rank, world_size)
        import torch.distributed.distributed_c10d as c10d

        collective = self._process_group_kwargs.get("timeout")
        self._process_group_kwargs["timeout"] = timedelta(seconds=env.rdzv_timeout or DEFAULT_RDZV_TIMEOUT)
        super().setup(local_rank, world_size)
        c10d._set_pg_timeout(collective or timedelta(minutes=30))
        nproc = self._num_local_workers
        rank_process.exchange_roster(env.node_rank or 0, env.nnodes, self._workers_global_rank + local_rank,
                                     range(self._workers_global_rank, self._workers_global_rank + nproc))

    def _own_gpu(self, local_rank: int) -> int:
        """``local_rank``'s GPU; a rank spawned beyond the GPUs (``NBDDP_NPROC`` set by hand) ends in one line."""
        from nbddp.contracts.devices import rank_gpu
        from nbddp.contracts.errors import DeviceError

        how = _by_hand("{n}")
        try:
            return rank_gpu(local_rank, torch.cuda.device_count(), self._num_local_workers, how=how)
        except DeviceError as exc:
            rank_process.refuse(self._workers_global_rank + local_rank, exc)

    def cleanup(self) -> None:
        """Leave the group the way the torch engine does (see :func:`nbddp.rank_side.process.leave_group`)."""
        rank_process.leave_group()


class UnpicklableError(TypeError):
    """Something Catalyst's spawn must send to the ranks can't be pickled (raised before spawning)."""


def check_picklable(fn: Callable[..., Any]) -> None:
    """Fail before spawning, naming the notebook cell of the culprit, instead of deep in pickle (``fn``: what
    Catalyst spawns, the runner's bound method)."""
    from multiprocessing.reduction import ForkingPickler

    try:
        ForkingPickler.dumps(fn)
        return
    except Exception as exc:  # noqa: BLE001 - any pickling failure is reported the same way
        reason = f"{type(exc).__name__}: {exc}"
    path, culprit = _find_unpicklable(getattr(fn, "__self__", fn), "runner")
    where = _where_defined(culprit)
    raise UnpicklableError(
        f"{where + ': ' if where else ''}Catalyst's DDP engine sends the runner and everything given to "
        f"runner.train to its processes by pickling, and {path} ({type(culprit).__name__}) can't be pickled "
        f"({reason}). Define it with `def`/`class` at the top level of a '#| ddp' cell instead of a lambda "
        "or a nested function." + see("catalysts-ddp-engine-sends-the-runner-cant-be-pickled")
    )


def _find_unpicklable(obj: object, path: str, depth: int = 0) -> tuple[str, object]:
    """The innermost attribute/item of ``obj`` that fails to pickle, with a readable path to it."""
    from multiprocessing.reduction import ForkingPickler

    if depth > 6:
        return path, obj
    children = []
    if isinstance(obj, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif hasattr(obj, "__dict__") and not callable(getattr(obj, "__code__", None)):
        children = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    import types

    for child_path, child in children:
        if isinstance(child, types.MethodType):
            continue  # pickling a bound method pickles its owner: it leads back up, not down
        try:
            ForkingPickler.dumps(child)
        except Exception:  # noqa: BLE001 - any pickling failure: look inside that child
            return _find_unpicklable(child, child_path, depth + 1)
    return path, obj


def _where_defined(obj: object) -> str | None:
    """``nb.ipynb, cell 3, line 4`` for a function defined in the generated script."""
    from pathlib import Path

    from nbddp.contracts.sourcemap import SourceMap, sourcemap_path

    code = getattr(obj, "__code__", None)
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if code is None or main is None or Path(code.co_filename).resolve() != Path(main).resolve():
        return None
    try:
        return SourceMap.load(sourcemap_path(main)).where(code.co_firstlineno)
    except (OSError, ValueError, KeyError):
        return None


def engine_kwargs() -> dict[str, Any]:
    """What nbddp builds Catalyst's DDP engine with: the requested devices on a free loopback port
    (on CPU ``cpu=True`` and gloo, without which every rank believes it is the main process)."""
    nproc, cpu = requested_processes()
    kwargs: dict[str, Any] = {"address": "127.0.0.1", "port": free_port(), "world_size": nproc,
                              "num_node_workers": nproc}
    env = RankEnv.from_environ()
    if env.nnodes and env.nnodes > 1:  # one node of several: node 0's rank 0 listens at the rendezvous endpoint
        host, _, port = env.master.rpartition(":")
        kwargs.update(address=host.strip("[]"), port=int(port), world_size=nproc * env.nnodes,
                      workers_dist_rank=(env.node_rank or 0) * nproc)
    group: dict[str, Any] = {"backend": "gloo"} if cpu else {}
    timeout = rank_process.collective_timeout()
    if timeout is not None:
        group["timeout"] = timeout
    if cpu:
        kwargs.update(cpu=True)
    if group:
        kwargs["process_group_kwargs"] = group
    return kwargs


def make_engine() -> NbddpDistributedDataParallelEngine:
    """Catalyst's DDP engine built with :func:`engine_kwargs`."""
    apply_catalyst_shims()
    kwargs = engine_kwargs()
    # Catalyst's engine reads these before its own defaults (2112 would collide between runs).
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = kwargs["address"], str(kwargs["port"])
    return NbddpDistributedDataParallelEngine(**kwargs)


def _rank_main(local_rank: int, fn: Callable[[int, int], Any], world_size: int, first_rank: int = 0) -> None:
    """Entry of each spawned rank: per-rank logs and error file, then Catalyst's own function.

    ``first_rank``: the global rank of this node's first process (its node rank × processes per node).
    """
    global_rank = first_rank + local_rank
    rank_process.become_rank(global_rank, world_size)
    apply_catalyst_shims()
    try:
        fn(local_rank, world_size)
        rank_process.mark_done(global_rank)
        rank_process.skip_final_collection()
    except KeyboardInterrupt:
        sys.exit(Status.INTERRUPTED.exit_code)  # torch's spawn wrapper would turn this into a silent exit 0
    except BaseException:
        rank_process.record_exception(global_rank, *sys.exc_info())
        raise


def patch_runner_train(returns: Sequence[str] = ("model",)) -> None:
    """Wrap ``catalyst.runners.runner.Runner.train`` so the user's call runs distributed.

    The call stays as the user wrote it; only ``engine`` is replaced and a
    callback that hands the trained model back is added.
    """
    if _state["patched"]:
        return
    from catalyst.runners.runner import Runner

    original = Runner.train

    def train(self: Runner, *args: Any, **kwargs: Any) -> None:
        kwargs["engine"] = engine = make_engine()
        kwargs["callbacks"] = _with_return_callback(kwargs.get("callbacks"), returns[0])
        if type(self).get_engine is not Runner.get_engine:  # a runner of the notebook's whose get_engine is its own:
            self.get_engine = _GivenEngine(engine)  # Catalyst asks it, not train's engine=, for the ranks to spawn
        result = original(self, *args, **kwargs)
        _state["trained"] = True
        return result

    train.__wrapped__ = original
    Runner.train = train
    _state["patched"] = True


class _GivenEngine:
    """A runner's ``get_engine`` that returns nbddp's engine: an object, not a closure, as the runner goes to every
    spawned rank pickled (its bound ``_run_local``)."""

    def __init__(self, engine: dl.DistributedDataParallelEngine) -> None:
        self.engine = engine

    def __call__(self) -> dl.DistributedDataParallelEngine:
        return self.engine


def _with_return_callback(callbacks: dict[str, Callback] | Sequence[Callback] | None,
                          name: str) -> dict[str, Callback] | list[Callback]:
    callback = ReturnModelCallback(name)
    if callbacks is None:
        return {"_nbddp_return": callback}
    if isinstance(callbacks, dict):
        return {**callbacks, "_nbddp_return": callback}
    return [*callbacks, callback]


class ReturnModelCallback(Callback):
    """On rank 0 at the end of training, save the runner's model (its best checkpoint if kept)."""

    def __init__(self, name: str = "model") -> None:
        super().__init__(order=CallbackOrder.External + 50)
        self.name = name

    def on_epoch_end(self, runner: IRunner) -> None:
        """Catalyst's epoch metrics become ``nbddp.log`` records: live view, summary, batches."""
        if runner.engine.process_index != 0:
            return
        values = {
            f"{loader}/{name}": value
            for loader, metrics in runner.epoch_metrics.items() if not loader.startswith("_")
            for name, value in metrics.items() if "/" not in name and name not in ("lr", "momentum")
        }
        runtime.log(epoch=runner.epoch_step, epochs=runner.num_epochs, **values)

    def on_experiment_end(self, runner: IRunner) -> None:
        from nbddp.contracts import checkpoint

        if runner.engine.process_index != 0:
            return
        model = runner.engine.unwrap_model(runner.model)
        state, note = checkpoint.state_of(model), "the runner's final model"
        best = _best_checkpoint(runner)
        if best is not None:
            import torch

            path, metric, name = best
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(loaded, dict) and loaded.keys() == state.keys():
                state, note = loaded, f"the runner's best checkpoint {path} ({name}={metric:.4g})"
        checkpoint.save_returns({self.name: state}, rank_process.checkpoint_path(), note=note)
        print(f"[nbddp] returning {note}", flush=True)


def _best_checkpoint(runner: IRunner) -> tuple[str, float, str] | None:
    """The best model checkpoint a Catalyst ``CheckpointCallback`` kept, if any."""
    from catalyst.callbacks.checkpoint import CheckpointCallback

    for callback in getattr(runner, "callbacks", {}).values():
        if (
            isinstance(callback, CheckpointCallback)
            and callback.mode == "model"
            and callback.metric_key is not None
            and callback._storage
        ):
            best = callback._storage[0]
            return (str(best.logpath), float(best.metric),
                    f"{callback.loader_key or ''}.{callback.metric_key}".strip("."))
    return None
