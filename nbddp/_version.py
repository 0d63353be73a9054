"""nbddp's version, a leaf: the script's header, ``result.json`` and a Slurm job's batch script name it
without importing the package's front door (``nbddp/__init__.py``, which loads the doors on first use)."""

__version__ = "0.1.0"
