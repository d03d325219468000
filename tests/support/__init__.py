"""What the tests share, one module per job:

- ``headers``: the /forward protocol's header names, spelled out (never imported from ``daemon``);
- ``http_client``: the one HTTP client (raw requests, JSON, streamed chats);
- ``meshd``: starting ``meshd`` (a node, a mesh of nodes, or the command run to its end);
- ``meshd_variants``: meshd with a test-only twist (an older tail, a slow or forgetful node);
- ``watch``: a thread that polls every node while a test runs;
- ``tiny_models``, ``fuzz_cases``, ``openai_clients``, ``tui_data``: models, cases, fixtures and fake data.
"""
