"""Warm ranks, the rank's side: one process that runs job after job, and keeps the setup between them.

:mod:`.loop` takes each job the kernel hands out, runs it as a fresh run would and leaves it when stopped;
:mod:`.state` decides which setup cells a job may skip (their code, their inputs and what they built are
unchanged) and restores what they left: :mod:`.script_units` splits the script into its cells,
:mod:`.kept_objects` keeps and checks the objects they bound, :mod:`.object_state` captures and restores
what those objects hold, and :mod:`.process_state` what the process holds besides them (folder, ``sys.path``,
environment, torch's settings, random generators), for the loop around each job and the state after each kept
cell alike. The kernel's half is :mod:`nbddp.launchers.warm`.
"""
