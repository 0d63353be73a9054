"""The notebook side: read a notebook, choose its cells, check them, and write the training script.

read (:mod:`.reader`) → cells and their IPython syntax (:mod:`.cells`) → parameters
(:mod:`.parameters`, written as literals by :mod:`.literals`) → names the code needs
(:mod:`.freevars`) → the script and its source map (:mod:`.script`, :mod:`.sourcemap`).
Nothing here imports torch.
"""
