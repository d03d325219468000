"""The /forward protocol's header names, as the tests spell them.

Spelled out here, not imported from ``daemon.wire``: a header renamed in the daemon breaks a test, as it would
break every node of an older version on the mesh.
"""

SESSION = "X-Meshnet-Session"
CACHE = "X-Meshnet-Cache"
PAST_LEN = "X-Meshnet-Past-Len"
START_LAYER = "X-Meshnet-Start-Layer"
HOP_INDEX = "X-Meshnet-Hop-Index"
DTYPE = "X-Meshnet-Dtype"
SHAPE = "X-Meshnet-Shape"
SAMPLING = "X-Meshnet-Sampling"
REQUEST_ID = "X-Request-Id"
PREFIX = "X-Meshnet-Prefix"
PREFIX_MODE = "X-Meshnet-Prefix-Mode"
