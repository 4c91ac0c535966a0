#!/usr/bin/env bash
# The online-RL learning record: the service and an openai-client agent in separate processes, 4 minutes.
set -u
OUT=${1:?OUTDIR}; PORT=${PORT:-8391}; MIN=${MIN:-4}
mkdir -p "$OUT"; rm -rf "$OUT/run"
python -m rlcore.online serve --run-dir "$OUT/run" --port $PORT --threads 1 --batch-sessions 64 \
    --min-batch-sessions 32 --progress-every-s 30 --minutes $(python -c "print($MIN + 1)") > "$OUT/serve.log" 2>&1 &
SVC=$!
until curl -s 127.0.0.1:$PORT/health > /dev/null; do sleep 1; done
KEY=$(python -m rlcore.online keys create --url http://127.0.0.1:$PORT --admin-key "$(cat $OUT/run/admin_key)" \
      --name agent | python -c "import json,sys; print(json.load(sys.stdin)['api_key'])")
python experiments/online_agent.py --url http://127.0.0.1:$PORT --api-key "$KEY" --minutes $MIN --concurrency 64 \
    --window 1024 > "$OUT/agent.jsonl"
kill $SVC; wait $SVC
uptime > "$OUT/uptime.txt"
