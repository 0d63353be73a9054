"""The contracts: what crosses a process boundary or what every layer reads, importing nothing above it.

Files and folders shared by processes — a run dir's names (:mod:`.rundir`), a warm pool's folder
(:mod:`.pool_dir`), the rank's environment as the launcher sets it (:mod:`.rank_env`), statuses
(:mod:`.status`), metrics (:mod:`.metrics`), memory reports (:mod:`.rank_memory`), a script's source map
(:mod:`.sourcemap`), the returned weights (:mod:`.checkpoint`) — and the leaves every layer uses: the
exceptions (:mod:`.errors`), atomic writes (:mod:`.atomic`), who owns a file (:mod:`.owned`), free ports
(:mod:`.ports`), which devices a run uses (:mod:`.devices`), a cell's tree, parsed once (:mod:`.cell_tree`),
the names it reads and binds (:mod:`.freevars`) and its role names (:mod:`.role_names`). A rank imports only this
package and the rank side, so an exported script needs nothing of the plan, the launchers or the job. Nothing here
imports torch at import time.
"""
