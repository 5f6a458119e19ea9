#!/usr/bin/env bash
# Starts the demo: web (gunicorn) + one inference worker + one fine-tuning trainer for the demo's base (keys.json
# names it), all in the background, waits until real requests have been answered, prints URLs, logins, the base's
# and each adapter's answer to the same question, per-tenant snippets and a fine-tuning snippet, then waits.
# Ctrl-C stops them all. Called by `make demo` after `manage.py migrate` and `manage.py demo_setup`.
#
#   bash scripts/run_demo.sh [HOST] [PORT]        (default 127.0.0.1 8000)
set -euo pipefail

HOST="${1:-127.0.0.1}"
PORT="${2:-8000}"
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
VAR_DIR="${LORAFLEET_VAR_DIR:-var}"
DEMO_DIR="$VAR_DIR/demo"
KEYS="$DEMO_DIR/keys.json"
LOGS="$DEMO_DIR/logs"
STARTED=$(date +%s)

[ -f "$KEYS" ] || { echo "No $KEYS: run 'make demo' (or 'manage.py demo_setup') first." >&2; exit 1; }
mkdir -p "$LOGS"

if "$PY" - "$HOST" "$PORT" <<'PY'
import socket, sys
s = socket.socket()
try:
    s.bind((sys.argv[1], int(sys.argv[2])))
except OSError:
    sys.exit(0)  # in use
sys.exit(1)
PY
then
    echo "Port $PORT on $HOST is in use; run 'make demo DEMO_PORT=8001' (or stop what listens there)." >&2
    exit 1
fi

# The admin's CSS is served by WhiteNoise from STATIC_ROOT.
"$PY" manage.py collectstatic --noinput -v 0

PIDS=()
stop() {
    trap - INT TERM EXIT
    if [ "${#PIDS[@]}" -gt 0 ]; then
        echo
        echo "Stopping web, worker and trainer ..."
        for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
        for pid in "${PIDS[@]}"; do
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
            kill -KILL "$pid" 2>/dev/null || true
        done
    fi
}
trap stop EXIT
trap 'exit 130' INT TERM

BASE_SLUG=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["base"]["slug"])' "$KEYS")
echo "Starting the inference worker for base $BASE_SLUG (log: $LOGS/worker.log) ..."
# The worker's default task threads (LORAFLEET_WORKER_CONCURRENCY, 128) and a web with as many threads: above
# the demo tenants' concurrency cap (64), so one tenant at its cap never holds every thread of either.
"$PY" manage.py run_worker --base "$BASE_SLUG" --metrics-port 0 >"$LOGS/worker.log" 2>&1 &
PIDS+=($!)
echo "Starting the fine-tuning trainer for base $BASE_SLUG (log: $LOGS/trainer.log) ..."
# Its own process: training never takes the inference worker's memory or batch (docs: fine-tuning). Its OpenMP
# threads sleep when idle instead of spinning: here it shares the cores with the worker and the web server.
OMP_WAIT_POLICY=PASSIVE "$PY" manage.py run_trainer --base "$BASE_SLUG" >"$LOGS/trainer.log" 2>&1 &
PIDS+=($!)
echo "Starting the web server on http://$HOST:$PORT (log: $LOGS/web.log) ..."
"$PY" -m gunicorn config.wsgi:application --bind "$HOST:$PORT" --workers 1 --threads 128 --timeout 120 \
    >"$LOGS/web.log" 2>&1 &
PIDS+=($!)

# Ready means: real completions went through web -> queue -> worker -> back, for the base and for every
# demo adapter. The same requests (greedy) give the answers printed below.
"$PY" - "$HOST" "$PORT" "$KEYS" "$STARTED" "${PIDS[@]}" <<'PY'
import json, os, sys, time, urllib.error, urllib.request
from concurrent.futures import ThreadPoolExecutor

host, port, keys_path, started = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
pids = [int(p) for p in sys.argv[5:]]
state = json.load(open(keys_path))
url = f"http://{host}:{port}"
MAX_TOKENS = 40
base = state["base"]
questions = state.get("questions") or {}


def alive() -> None:
    for pid in pids:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = 0  # not our child (the shell's): probe it instead
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                done = pid
        if done:
            sys.exit(f"A demo process ({pid}) exited during start-up; see {os.path.dirname(keys_path)}/logs/.")


def ask(key: str, model: str, question: str, timeout: float = 120.0) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}],
                       "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def ask_until_up(key: str, model: str, question: str) -> dict:
    while True:  # worker up? the first answer also loads the adapter
        alive()
        try:
            return ask(key, model, question)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if time.time() > deadline:
                sys.exit(f"No answer from the worker in time ({exc}); see the worker log.")
            time.sleep(1.0)


deadline = time.time() + 240
while True:  # web up?
    alive()
    try:
        urllib.request.urlopen(f"{url}/login/", timeout=2).read()
        break
    except (urllib.error.URLError, OSError):
        if time.time() > deadline:
            sys.exit("The web server did not come up in time; see the web log.")
        time.sleep(0.5)

# Per adapter: its question asked of the base (explicitly, as "base/<slug>") and of the adapter. All at
# once, as different tenants' traffic would come: the worker batches them into shared forward passes.
asks = []
for tenant, adapters in state["adapters"].items():
    for model in adapters:
        question = questions.get(model, "What did you do today?")
        asks += [(tenant, model, question, model), (tenant, model, question, "base/" + base["slug"])]
with ThreadPoolExecutor(len(asks)) as pool:
    replies = list(pool.map(lambda a: ask_until_up(state["api_keys"][a[0]], a[3], a[2]), asks))
answers = {}
for (tenant, model, question, asked), reply in zip(asks, replies):
    meta = reply.get("lorafleet", {})
    answers[(tenant, model, asked)] = (reply["choices"][0]["message"]["content"], meta.get("version"),
                                       (meta.get("weights_sha256") or meta.get("adapter_sha256") or "")[:12])


def oneline(text: str) -> str:
    return " / ".join(line.strip() for line in text.strip().splitlines() if line.strip()) or "(empty)"


logins = state["logins"]
rule = "=" * 78
print()
print(rule)
print(f" lorafleet demo is running ({time.time() - started:.0f} s to start this script). Ctrl-C stops it.")
print(rule)
print(f" Dashboard  {url}/        logins: alice / {logins['alice']}   (acme owner)")
print(f"                          bob / {logins['bob']}     (acme viewer)")
print(f"                          charlie / {logins['charlie']} (globex owner)")
print(f" Admin      {url}/admin/  login:  admin / {logins['admin']}")
print(f" API docs   {url}/api/docs/")
print(f" Keys and logins are in {keys_path} (mode 0600): secrets are shown once.")
if base.get("kind") == "tiny":
    print()
    print(" NOTICE: this demo runs on the tiny local base (SmolLM2 could not be installed): its answers are")
    print(" barely English. With the package registry reachable, `make demo` uses SmolLM2-135M-Instruct.")
print()
print(f" One base model, {base.get('display_name', base['slug'])}, and each tenant's own adapter weights")
print(f" (greedy, max_tokens {MAX_TOKENS}):")
for tenant, adapters in state["adapters"].items():
    for model in adapters:
        question = questions.get(model, "What did you do today?")
        text, version, sha = answers[(tenant, model, model)]
        print()
        print(f'   {tenant}/{model} v{version} ({sha}) — "{question}"')
        print(f"     base    -> {oneline(answers[(tenant, model, 'base/' + base['slug'])][0])}")
        print(f"     {model:7s} -> {oneline(text)}")
for tenant, adapters in state["adapters"].items():
    key = state["api_keys"][tenant]
    model = adapters[0]
    question = questions.get(model, "What did you do today?")
    print()
    print(f"--- {tenant}: adapters {', '.join(adapters)} " + "-" * max(0, 60 - len(tenant) - len(', '.join(adapters))))
    print(f"curl -s {url}/v1/chat/completions \\")
    print(f'  -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\')
    print(f"  -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"{question}\"}}], "
          f"\"max_tokens\": {MAX_TOKENS}, \"temperature\": 0}}'")
    print()
    print(".venv/bin/python - <<'EOF'")
    print("from openai import OpenAI")
    print(f'client = OpenAI(base_url="{url}/v1", api_key="{key}")')
    print(f'reply = client.chat.completions.create(model="{model}", max_tokens={MAX_TOKENS}, temperature=0,')
    print(f'    messages=[{{"role": "user", "content": "{question}"}}])')
    print("print(reply.choices[0].message.content)")
    print("EOF")
ft_key, ft_data = state["api_keys"]["globex"], state.get("finetune_dataset")
if ft_data:
    print()
    print("--- fine-tuning: globex trains its own \"lister\" from the demo's JSONL (minutes on two cores) ---")
    print(".venv/bin/python - <<'EOF'")
    print("import time")
    print("from openai import OpenAI")
    print(f'client = OpenAI(base_url="{url}/v1", api_key="{ft_key}")')
    print(f'f = client.files.create(file=open("{ft_data}", "rb"), purpose="fine-tune")')
    print(f'job = client.fine_tuning.jobs.create(training_file=f.id, model="{base["slug"]}", suffix="lister", seed=1,')
    print('    hyperparameters={"n_epochs": 2, "batch_size": 8, "learning_rate_multiplier": 25})')
    print('while job.status not in ("succeeded", "failed", "cancelled"):')
    print("    time.sleep(5)")
    print("    job = client.fine_tuning.jobs.retrieve(job.id)")
    print("    print(job.status, *[e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=1).data])")
    print("print(job.status, job.fine_tuned_model, job.error)")
    print(f'reply = client.chat.completions.create(model=job.fine_tuned_model, max_tokens={MAX_TOKENS}, temperature=0,')
    print(f'    messages=[{{"role": "user", "content": "{questions.get("lister", "What did you do today?")}"}}])')
    print("print(reply.choices[0].message.content)")
    print("EOF")
    print(f" Or in the dashboard: {url}/fine-tuning/ (charlie): upload the file, start a job, watch its loss.")
print()
print(' Rollback: acme\'s "shouty" has two versions (v1 was trained for half the epochs). Pin one with')
print(' "model": "shouty@1", or make v1 live in the dashboard (Adapters -> shouty -> activate v1) and ask again.')
print(f' The base itself answers to "model": "base/{base["slug"]}".')
print(rule)
PY

wait -n "${PIDS[@]}" || true
echo "A demo process stopped; see $LOGS/. Stopping the other." >&2
exit 1
