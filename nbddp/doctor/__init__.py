"""``nbddp doctor``: what stops distributed training on this machine, each found in a subprocess of its own.

The failures people meet most when training with DDP are in the machine, not the code: NCCL hanging between GPUs
without peer-to-peer, a container's 64 MB ``/dev/shm``, fewer GPUs than asked or GPUs someone else holds, a memlock
or open-file limit, a runs folder another user owns, a port in use, a cluster's endpoint that doesn't answer. Each
costs a hang or a cryptic backend message. The doctor looks for each the way a run meets it, for the run the user
asks for (the launch options of ``nbddp run``), and says in one line what is wrong, what it breaks and the fix.

* :mod:`~nbddp.doctor.ask`: what is examined: the run asked for, as data a check's subprocess reads;
* :mod:`~nbddp.doctor.verdict`: a check's answer (ok, the line, what it found);
* :mod:`~nbddp.doctor.examine`: the checks in subprocesses at once, each with its own time limit, never hanging;
  the NCCL transports tried one by one when the all-reduce hangs;
* :mod:`~nbddp.doctor.checks`: each check's body (run in the subprocess, ``python -m nbddp.doctor.checks``);
* :mod:`~nbddp.doctor.allreduce`: one rank of the all-reduce a run's first collective is;
* and on the job's side, :mod:`nbddp.job.diagnosis`: which check explains a run that failed where the machine is the
  usual cause, run then for that check alone.

Nothing here imports torch in the doctor's own process: the checks that need it import it in their subprocess.
"""
