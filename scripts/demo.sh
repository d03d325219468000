#!/usr/bin/env bash
# Set up, start a two-node mesh on 127.0.0.1 (layers 0-14 and 15-29 of the built-in model),
# ask it one question through the OpenAI-compatible API, print the answer, and stop the nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
PROMPT="${1:-Explain in two sentences what a pipeline-parallel language model is.}"
.venv/bin/meshd fetch-model
LOGS="$(mktemp -d)"
.venv/bin/meshd --layers 15-29 --port 7071 >"$LOGS/tail.log" 2>&1 &
TAIL=$!
.venv/bin/meshd --layers 0-14 --port 7070 --peer http://127.0.0.1:7071 >"$LOGS/head.log" 2>&1 &
HEAD=$!
trap 'kill $HEAD $TAIL 2>/dev/null; wait $HEAD $TAIL 2>/dev/null || true' EXIT
.venv/bin/python - "$PROMPT" <<'PY'
import json, sys, time, urllib.request
def get(url):
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())
deadline = time.time() + 120
while True:
    try:
        if any(p["up"] for p in get("http://127.0.0.1:7070/v1/status")["peers"]):
            break
    except OSError:
        pass
    if time.time() > deadline:
        sys.exit("meshd did not come up; see the logs")
    time.sleep(0.5)
route = get("http://127.0.0.1:7070/v1/route?refresh=1")
print("route:", "  ->  ".join(f"{h['url']} layers {h['start_layer']}-{h['end_layer'] - 1}" for h in route["hops"]))
print("you:", sys.argv[1])
body = json.dumps({"messages": [{"role": "user", "content": sys.argv[1]}], "max_tokens": 200}).encode()
req = urllib.request.Request("http://127.0.0.1:7070/v1/chat/completions", body, {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=600) as r:
    answer = json.loads(r.read())
stats = answer["meshnet"]
print("mesh:", answer["choices"][0]["message"]["content"].strip())
print(f"({stats['completion_tokens']} tokens, {stats['decode_tokens_per_second'] or 0:.1f} tokens/s decode, "
      f"prefill {stats['prefill_ms']:.0f} ms)")
PY
