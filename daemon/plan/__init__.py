"""``meshd plan``: how to split a model over the machines at hand, and how many sessions then fit.

``command`` holds the command line (:func:`main`, reached from ``meshd plan``); ``split`` the arithmetic
of layer ranges and cache room; ``report`` the table and the JSON. The model itself is read, configs
and headers only, by :mod:`daemon.model.footprint`. Nothing here is imported by a running node.
"""

from daemon.plan.command import main, parse_size
from daemon.plan.split import MeshPlan, NodePlan, plan_mesh

__all__ = ["MeshPlan", "NodePlan", "main", "parse_size", "plan_mesh"]
