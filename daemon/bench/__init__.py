"""``meshd bench``: the mesh measured side by side with one process running the same model.

``run`` holds the command (:func:`main`, reached from ``meshd bench``); ``reference`` the single-process
limit; ``mesh`` the meshd processes under test; ``reuse`` prompt reuse (a multi-turn chat, clients with
one system prompt) warm against cold; ``floor`` and ``floor_server`` what a bare loopback hop costs;
``report`` the windows, targets and tables; ``progress`` the lines on stderr. Nothing here is imported
by a running node.
"""

from daemon.bench.mesh import Mesh, mesh_row
from daemon.bench.report import check_targets, window_tps
from daemon.bench.run import main

__all__ = ["Mesh", "check_targets", "main", "mesh_row", "window_tps"]
