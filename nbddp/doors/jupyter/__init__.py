"""The IPython shell of nbddp: the %%ddp_train magic and its live view."""
