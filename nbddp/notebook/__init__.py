"""The notebook side: read a notebook, choose its cells, check them, and write the training script.

read (:mod:`.reader`) → cells and their IPython syntax (:mod:`.cells`) → parameters
(:mod:`.parameters`, written as literals by :mod:`.literals`) → roles and unmarked notebooks
(:mod:`.roles`, :mod:`.unmarked`) → the script (:mod:`.script`). The names a cell needs and its source
map are contracts the ranks read too (:mod:`nbddp.contracts.freevars`, :mod:`nbddp.contracts.sourcemap`).
Nothing here imports torch.
"""
