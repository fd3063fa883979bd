#!/usr/bin/env bash
# One turn of each agent CLI against a real `inferd serve`: Codex (`codex exec`, the Responses API)
# and Claude Code (`claude -p`, the Anthropic Messages API). Issue 29's acceptance item. Then a
# second Claude Code turn of the same session (`--continue`): the share of its prompt the server's
# prefix cache served (issue 43: the billing header dropped, the session's prefix retained).
#
#   bench/agent_clis.sh [--url URL] [--out DIR] [--api-key KEY] [--timeout S] [--no-isolate]
#
# The CLIs come from the npm registry, pinned (CODEX_VERSION, CLAUDE_VERSION below), installed once
# into ${INFERD_AGENT_CLIS_DIR:-$HOME/.cache/inferd/agent-clis}; each package carries its native
# binary, nothing else is downloaded. Without --url the script starts `inferd serve --port 0` on the
# default model (Python: $INFERD_PYTHON, else the repo's .venv, else python3) and, where `unshare
# -rn` works, runs the server and both CLIs in a network namespace whose only interface is the
# loopback: nothing can reach beyond 127.0.0.1, and the turns still have to succeed.
#
# Both default system prompts (~9k and ~13k tokens) and Claude Code's default tool list (~19k
# tokens) overflow the default model's 8k context, so each is trimmed with the CLI's own option:
# Codex's base instructions by `model_instructions_file` in its config; Claude Code's by
# `--system-prompt`, its tools by `--tools ""`. Codex keeps its default tools (function tools and
# a `namespace` of sub-agent functions), Claude Code its default request fields.
#
# Out ($OUT, default a new temp folder): codex.jsonl (its --json events), claude.json and
# claude-2.json (its --output-format json results), serve.log and requests.jsonl (the server's one line per request:
# path, status, cached tokens) when the script started the server, summary.json. Exit 0 when both CLIs exit 0
# with a non-empty answer; the last line printed is the summary's path.
set -euo pipefail

CODEX_VERSION=0.169.1
CLAUDE_VERSION=2.1.332
URL=""
OUT=""
API_KEY="${INFERD_API_KEY:-none}"
TIMEOUT=900
ISOLATE=1
PROMPT="What is the capital of France? Answer in one word."
PROMPT2="And of Italy? Answer in one word."
SYSTEM="You are a helpful assistant. Answer briefly."
while [[ $# -gt 0 ]]; do
    case "$1" in
        --url) URL="${2%/}"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --api-key) API_KEY="$2"; shift 2 ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        --no-isolate) ISOLATE=0; shift ;;
        --in-netns) ISOLATE=2; shift ;;  # (internal: already inside the namespace)
        -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option: $1" >&2; exit 2 ;;
    esac
done

HERE="$(cd "$(dirname "$0")/.." && pwd)"
CLI_DIR="${INFERD_AGENT_CLIS_DIR:-$HOME/.cache/inferd/agent-clis}"
CODEX="$CLI_DIR/node_modules/.bin/codex"
CLAUDE="$CLI_DIR/node_modules/.bin/claude"
OUT="${OUT:-$(mktemp -d -t agent-clis.XXXXXX)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# ---------------------------------------------------------------- install (the only network use)
installed() { [[ -x "$CODEX" && -x "$CLAUDE" ]] && "$CODEX" --version 2>/dev/null | grep -q " $CODEX_VERSION\$" \
    && "$CLAUDE" --version 2>/dev/null | grep -q "^$CLAUDE_VERSION "; }
if [[ $ISOLATE != 2 ]] && ! installed; then
    command -v npm >/dev/null || { echo "error: npm not found (Debian: apt-get install -y nodejs npm)" >&2; exit 3; }
    echo "installing @openai/codex@$CODEX_VERSION @anthropic-ai/claude-code@$CLAUDE_VERSION into $CLI_DIR" >&2
    mkdir -p "$CLI_DIR"
    npm install --prefix "$CLI_DIR" --no-audit --no-fund --no-save \
        "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_VERSION" >"$OUT/npm.log" 2>&1 \
        || { tail -n 20 "$OUT/npm.log" >&2; echo "error: npm install failed (log: $OUT/npm.log)" >&2; exit 3; }
    # Claude Code's postinstall puts the native binary in place; npm may hold install scripts back
    [[ -x "$CLAUDE" ]] && "$CLAUDE" --version >/dev/null 2>&1 \
        || (cd "$CLI_DIR/node_modules/@anthropic-ai/claude-code" && node install.cjs >&2)
    installed || { echo "error: the installed CLIs do not report $CODEX_VERSION / $CLAUDE_VERSION" >&2; exit 3; }
fi

# ------------------------------------------------- a network namespace with the loopback only
if [[ -z "$URL" && $ISOLATE == 1 ]]; then
    if unshare -rn true 2>/dev/null && { command -v ip >/dev/null || [[ -x /usr/sbin/ip ]]; }; then
        echo "isolating: server and CLIs in a network namespace with only 127.0.0.1" >&2
        exec unshare -rn bash -c 'PATH="$PATH:/usr/sbin:/sbin" ip link set lo up && exec "$@"' _ \
            "$0" --in-netns --out "$OUT" --api-key "$API_KEY" --timeout "$TIMEOUT"
    fi
    echo "note: unshare -rn is not available here: not isolated (the CLIs' settings alone keep them local)" >&2
fi

# ---------------------------------------------------------------------------- the server
SERVER_PID=""
cleanup() { [[ -n "$SERVER_PID" ]] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null || true; }
trap cleanup EXIT
if [[ -z "$URL" ]]; then
    PY="${INFERD_PYTHON:-}"
    [[ -z "$PY" && -x "$HERE/.venv/bin/python" ]] && PY="$HERE/.venv/bin/python"
    PY="${PY:-python3}"
    : >"$OUT/serve.log"
    (cd "$OUT" && PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m inferd.cli serve --port 0 \
        --log-format json >/dev/null 2>"$OUT/serve.log") &
    SERVER_PID=$!
    for _ in $(seq 1 600); do
        URL="$(PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m inferd.api.startup "$OUT/serve.log" || true)"
        [[ -n "$URL" ]] && curl -sf "$URL/ready" >/dev/null 2>&1 && break
        kill -0 "$SERVER_PID" 2>/dev/null || { tail -n 20 "$OUT/serve.log" >&2; echo "error: inferd serve exited" >&2; exit 1; }
        URL=""; sleep 0.5
    done
    [[ -n "$URL" ]] || { echo "error: inferd serve was not ready in 300 s (log: $OUT/serve.log)" >&2; exit 1; }
fi
MODEL="$(curl -sf -H "Authorization: Bearer $API_KEY" "$URL/v1/models" \
    | node -e 'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>console.log(JSON.parse(s).data[0].id))')"
echo "server $URL, model $MODEL" >&2

# ---------------------------------------------------------------------------- Codex
mkdir -p "$OUT/codex-home" "$OUT/work"
echo "$SYSTEM" >"$OUT/codex-home/instructions.md"
cat >"$OUT/codex-home/config.toml" <<EOF
model = "$MODEL"
model_provider = "inferd"
model_context_window = 8192
model_instructions_file = "$OUT/codex-home/instructions.md"  # its own ~9k tokens would not fit
check_for_update_on_startup = false
web_search = "disabled"

[model_providers.inferd]
name = "inferd"
base_url = "$URL/v1"
wire_api = "responses"
env_key = "INFERD_API_KEY"
request_max_retries = 0
stream_max_retries = 0
supports_websockets = false

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
trace_exporter = "none"
metrics_exporter = "none"

[features]
plugins = false  # else it runs git against a public host to sync the plugin catalogue
EOF
start=$(date +%s)
set +e
(cd "$OUT/work" && CODEX_HOME="$OUT/codex-home" INFERD_API_KEY="$API_KEY" timeout "$TIMEOUT" \
    "$CODEX" exec --json --skip-git-repo-check "$PROMPT" </dev/null >"$OUT/codex.jsonl" 2>"$OUT/codex.err")
CODEX_RC=$?
set -e
CODEX_S=$(( $(date +%s) - start ))

# ---------------------------------------------------------------------------- Claude Code
mkdir -p "$OUT/claude-home"
# NOTE: Claude Code asks for 32,000 tokens (inferd lowers it to its ceiling) at Anthropic's default
# temperature 1, where the default model often rambles for hundreds of tokens; a reply cut at
# max_tokens makes Claude Code ask again for a shorter one, three times, then fail; greedy, it can
# repeat itself to the limit as well. So: greedy, the answer's first line (a stop sequence; both
# through CLAUDE_CODE_EXTRA_BODY, merged into its request body) and 200 tokens at most.
claude() {  # claude ARGS...: one turn, in the same home and folder (so --continue finds the session)
    (cd "$OUT/work" && env HOME="$OUT/claude-home" ANTHROPIC_BASE_URL="$URL" ANTHROPIC_API_KEY="$API_KEY" \
        ANTHROPIC_MODEL="$MODEL" ANTHROPIC_SMALL_FAST_MODEL="$MODEL" ANTHROPIC_DEFAULT_HAIKU_MODEL="$MODEL" \
        ANTHROPIC_DEFAULT_SONNET_MODEL="$MODEL" ANTHROPIC_DEFAULT_OPUS_MODEL="$MODEL" CLAUDE_CODE_SUBAGENT_MODEL="$MODEL" \
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=200 CLAUDE_CODE_EXTRA_BODY='{"temperature": 0, "stop_sequences": ["\n"]}' DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 DISABLE_ERROR_REPORTING=1 \
        DISABLE_BUG_COMMAND=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 timeout "$TIMEOUT" \
        "$CLAUDE" -p "$@" --output-format json --system-prompt "$SYSTEM" --tools "" </dev/null)
}
start=$(date +%s)
set +e
claude "$PROMPT" >"$OUT/claude.json" 2>"$OUT/claude.err"
CLAUDE_RC=$?
# a second turn of the same session (issue 43: its prompt should come from the prefix cache)
claude "$PROMPT2" --continue >"$OUT/claude-2.json" 2>"$OUT/claude-2.err"
CLAUDE2_RC=$?
set -e
CLAUDE_S=$(( $(date +%s) - start ))

# ---------------------------------------------------------------------------- the record
[[ -f "$OUT/serve.log" ]] && { grep '"inferd.requests"' "$OUT/serve.log" >"$OUT/requests.jsonl" || true; }
CODEX_V="$("$CODEX" --version 2>/dev/null)" CLAUDE_V="$("$CLAUDE" --version 2>/dev/null)" \
CODEX_RC=$CODEX_RC CODEX_S=$CODEX_S CLAUDE_RC=$CLAUDE_RC CLAUDE2_RC=$CLAUDE2_RC CLAUDE_S=$CLAUDE_S OUT="$OUT" URL="$URL" MODEL="$MODEL" \
ISOLATED=$([[ $ISOLATE == 2 ]] && echo true || echo false) node - <<'EOF'
const fs = require("fs"), env = process.env, out = env.OUT;
const read = (f) => (fs.existsSync(`${out}/${f}`) ? fs.readFileSync(`${out}/${f}`, "utf8") : "");
const lines = (f) => read(f).split("\n").filter(Boolean).map((l) => { try { return JSON.parse(l); } catch { return null; } }).filter(Boolean);
const events = lines("codex.jsonl");
const said = events.filter((e) => e.type === "item.completed" && e.item?.type === "agent_message").map((e) => e.item.text);
let claude = {}, claude2 = {};
try { claude = JSON.parse(read("claude.json")); } catch {}
try { claude2 = JSON.parse(read("claude-2.json")); } catch {}
const records = lines("requests.jsonl");
const messages = records.filter((r) => r.path === "/v1/messages" && r.status === 200);
const last = messages[messages.length - 1] || {};
const summary = {
  url: env.URL, model: env.MODEL, isolated: env.ISOLATED === "true",
  codex: { version: env.CODEX_V, exit: +env.CODEX_RC, seconds: +env.CODEX_S, answer: said.join("\n"),
           completed: events.some((e) => e.type === "turn.completed") },
  claude: { version: env.CLAUDE_V, exit: +env.CLAUDE_RC, seconds: +env.CLAUDE_S,
            answer: claude.is_error ? "" : (claude.result || ""), error: claude.is_error ? claude.result : null },
  claude_second_turn: { exit: +env.CLAUDE2_RC, answer: claude2.is_error ? "" : (claude2.result || ""),
                        prompt_tokens: last.prompt_tokens, cached_tokens: last.cached_tokens,
                        cached_share: last.prompt_tokens ? last.cached_tokens / last.prompt_tokens : null,
                        cache_miss: last.cache_miss },
  requests: records.map((r) => ({ path: r.path, status: r.status, prompt_tokens: r.prompt_tokens,
                                  cached_tokens: r.cached_tokens, cache_miss: r.cache_miss,
                                  completion_tokens: r.completion_tokens, e2e: r.e2e })),
};
fs.writeFileSync(`${out}/summary.json`, JSON.stringify(summary, null, 1) + "\n");
for (const name of ["codex", "claude"]) {
  const r = summary[name];
  console.error(`${name} ${r.version}: exit ${r.exit} in ${r.seconds} s, answer: ${JSON.stringify(r.answer)}`);
}
const t2 = summary.claude_second_turn;
console.error(`claude's second turn (--continue): exit ${t2.exit}, prompt ${t2.prompt_tokens} tokens, ` +
              `${t2.cached_tokens} from the prefix cache (${Math.round(100 * (t2.cached_share || 0))}%), miss: ${t2.cache_miss}`);
for (const r of summary.requests) console.error(`  server saw ${r.path} -> ${r.status}, cached ${r.cached_tokens}/${r.prompt_tokens}`);
EOF
echo "$OUT/summary.json"
ok() { [[ $1 == 0 ]] && node -e "process.exit(require('$OUT/summary.json').$2.answer.trim() ? 0 : 1)"; }
ok $CODEX_RC codex && ok $CLAUDE_RC claude
