"""meshd: a node of the meshnet mesh (import name ``daemon``)."""

__version__ = "0.1.0"
