"""What vulture can't see being used: ``vulture nbddp vulture_whitelist.py --min-confidence 60``.

Each name below is called or read by something outside nbddp's own code (Python itself, a library, an entry
point, a name in a string, the users of the package), as each group's comment says. The file is only parsed,
never imported. A name that is really unused is removed from the code instead of being added here.
"""

import sys
import tempfile

from vulture.whitelist_utils import Whitelist

import nbddp
import nbddp.engines.catalyst
import nbddp.engines.frameworks
import nbddp.engines.torch
from nbddp.api import BatchResult, load_weights
from nbddp.contracts.errors import NbddpError
from nbddp.contracts.rank_env import RankEnv
from nbddp.doors.jupyter.magics import DdpMagics
from nbddp.doors.nbconvert import NbddpExporter
from nbddp.doors.papermill import NbddpEngine
from nbddp.doors.tune.space import _Probe
from nbddp.doors.tune.study import TuneResult
from nbddp.engines.engine import Engine
from nbddp.job.trackers import share_open_records
from nbddp.launchers.ray import Ray
from nbddp.launchers.slurm import Slurm
from nbddp.launchers.warm.launcher import WarmRanks
from nbddp.plan.option_fields import Option
from nbddp.plan.options import SlurmRequest, options_table
from nbddp.rank_side.catalyst_engine import ReturnModelCallback, use_ddp
from nbddp.rank_side.torch_engine import save_checkpoint
from nbddp.rank_side.trackers import _NoRun

#: Stands for what no import reaches (a class made inside a function, an argument): vulture counts a name as used
#: wherever it is read.
_ = Whitelist()

# Module hooks of `import nbddp` (PEP 562): the lazy public names, and what dir(nbddp) lists.
nbddp.__getattr__
nbddp.__dir__

# The package's public API, for its users (README, docs): nbddp.save_checkpoint(...), nbddp.batch(...).dataframe().
save_checkpoint
BatchResult.dataframe
load_weights
TuneResult.best_params

# What IPython's display() reads of an object (the study's view: its HTML), and the rest of Optuna's trial API that a
# space function may call on the stand-in trial its names are found with (suggest_loguniform and the like).
_._repr_html_
_Probe.suggest_uniform
_Probe.suggest_loguniform
_Probe.suggest_discrete_uniform

# IPython's magics, registered by @magics_class and called as %ddp_ranks, %%ddp_train, %%ddp_exec, %ddp_debug,
# %ddp_attach, %ddp_doctor; IPython shows an exception by its _render_traceback_() where it has one.
DdpMagics.ddp_ranks
DdpMagics.ddp_train
DdpMagics.ddp_exec
DdpMagics.ddp_debug
DdpMagics.ddp_attach
DdpMagics.ddp_doctor
NbddpError._render_traceback_

# Entry points declared in pyproject.toml: nbconvert's exporter (with the traits and the default nbconvert reads)
# and papermill's engine (papermill's Engine.execute_notebook calls execute_managed_notebook).
NbddpExporter
NbddpExporter.export_from_notebook
NbddpExporter.output_mimetype
NbddpExporter._file_extension_default
NbddpEngine
NbddpEngine.execute_managed_notebook

# Named in strings, "module:attribute", and loaded on first use: the engines' records (nbddp.engines.BUILTIN) and
# the launchers (nbddp.launchers.BUILTIN).
nbddp.engines.torch.ENGINE
nbddp.engines.catalyst.ENGINE
nbddp.engines.frameworks.ACCELERATE
nbddp.engines.frameworks.LIGHTNING
nbddp.engines.frameworks.TRANSFORMERS
Slurm
Ray
WarmRanks

# Called from the code nbddp generates: a Catalyst script's `_nbddp.use_ddp(...)`, and the cell a notebook's
# kernel runs at its training cell (`from nbddp.job.trackers import share_open_records`).
use_ddp
share_open_records

# Dataclass fields read by name: each RankEnv field becomes its NBDDP_* variable (RankEnv.variables() walks the
# fields); detection asks each engine getattr(engine, "sets_up_with"); the Slurm request's partition, time and
# account go to sbatch by name (nbddp.launchers.slurm); an option's example is given to every door by the tests.
RankEnv.pool_owner
Engine.sets_up_with
SlurmRequest.account
Option.example

# Used by docs/hooks.py: the README's and the docs' table of launch options.
options_table

# Library callbacks: Catalyst calls its Callback's on_epoch_end/on_experiment_end; Lightning's Callback and the
# Hugging Face TrainerCallback made inside nbddp.rank_side.frameworks' adapters are called on_train_batch_end,
# on_train_epoch_end and on_log(args, state, control, logs), `control` passed whether used or not.
ReturnModelCallback.on_epoch_end
ReturnModelCallback.on_experiment_end
_.on_train_batch_end
_.on_train_epoch_end
_.on_log
_.control

# Signatures of the objects nbddp stands in for: torch's ProcessContext.join(timeout, grace_period) (what
# mp.spawn(join=False) returns), and mlflow's RunInfo (what a silent rank's mlflow.start_run() gives).
_.grace_period
_NoRun.info.artifact_uri

# Attributes Python itself reads: tempfile's folder, the hook breakpoint() calls, a function's signature and
# annotations (inspect.signature, help()), a class's qualified name (repr, pickling).
tempfile.tempdir
sys.breakpointhook
_.__signature__
_.__annotations__
_.__qualname__
