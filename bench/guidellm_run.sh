#!/usr/bin/env bash
# guidellm (the vLLM project's benchmark tool) against a real `inferd serve`: a short run that
# must complete every request.
#
#   bench/guidellm_run.sh [--url http://127.0.0.1:PORT] [--requests N] [--out FILE.json]
#
# guidellm lives in its own venv outside the repo (${INFERD_GUIDELLM_DIR:-$HOME/.cache/inferd/guidellm}:
# it pulls in datasets, pandas, pyarrow and sanic, which inferd's own venv does not need), with
# torch 2.13.0 installed first (the CPU wheel; left to itself pip takes a CUDA build of several
# GB). Its synthetic prompts need a Hugging Face tokenizer folder: the default model's tokenizer,
# written once from the GGUF by transformers (inferd's dev extra). Without --url the script
# starts `inferd serve` on a free port and stops it after. Nothing is fetched at run time but the
# packages; guidellm runs with HF_HUB_OFFLINE=1. The last line printed is
# "guidellm: N successful, N errored, N incomplete"; the exit status is 0 only when every
# request succeeded.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${INFERD_PYTHON:-$REPO/.venv/bin/python}"
DIR="${INFERD_GUIDELLM_DIR:-$HOME/.cache/inferd/guidellm}"
URL=""
REQUESTS=20
OUT=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --url) URL="$2"; shift 2 ;;
        --requests) REQUESTS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option: $1" >&2; exit 2 ;;
    esac
done

if [[ ! -x "$DIR/venv/bin/guidellm" ]]; then
    python3 -m venv "$DIR/venv"
    "$DIR/venv/bin/pip" install -q --no-compile torch==2.13.0
    "$DIR/venv/bin/pip" install -q --no-compile guidellm==0.8.1
fi
if [[ ! -f "$DIR/tokenizer/tokenizer.json" ]]; then
    "$PY" - "$DIR/tokenizer" <<'EOF'
import sys
from transformers import AutoTokenizer
from inferd.model.loading.loader import default_model_path
path = default_model_path()
AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(sys.argv[1])
EOF
fi

WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() { [[ -n "$SERVER_PID" ]] && kill "$SERVER_PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
if [[ -z "$URL" ]]; then
    (cd "$WORK" && exec "$PY" -m inferd.cli serve --port 0 --served-model-name smollm2 2> serve.log) &
    SERVER_PID=$!
    for _ in $(seq 1 600); do
        URL="$(grep -o 'on http://[0-9.]*:[0-9]*' "$WORK/serve.log" 2>/dev/null | head -1 | cut -c4-)" || true
        [[ -n "$URL" ]] && curl -sf "$URL/ready" >/dev/null && break
        URL=""
        sleep 0.2
    done
    [[ -n "$URL" ]] || { echo "inferd serve did not start:" >&2; cat "$WORK/serve.log" >&2; exit 1; }
fi

MODEL="$(curl -sf "$URL/v1/models" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
HF_HUB_OFFLINE=1 GUIDELLM__LOGGING__DISABLED=true "$DIR/venv/bin/guidellm" run \
    --backend "kind=openai_http,target=$URL,model=$MODEL" \
    --profile kind=synchronous --constraint "kind=max_requests,count=$REQUESTS" \
    --data kind=synthetic_text,prompt_tokens=64,output_tokens=16 \
    --tokenizer "kind=hf_auto,model=$DIR/tokenizer" \
    --output "kind=json,path=$WORK/guidellm.json" --disable-progress
[[ -n "$OUT" ]] && cp "$WORK/guidellm.json" "$OUT"
"$PY" - "$WORK/guidellm.json" <<'EOF'
import json, sys
requests = json.load(open(sys.argv[1]))["benchmarks"][0]["requests"]  # {outcome: [each request's stats]}
counts = {outcome: len(requests.get(outcome) or []) for outcome in ("successful", "errored", "incomplete")}
print(f"guidellm: {counts['successful']} successful, {counts['errored']} errored, {counts['incomplete']} incomplete")
sys.exit(0 if counts["successful"] and not counts["errored"] and not counts["incomplete"] else 1)
EOF
