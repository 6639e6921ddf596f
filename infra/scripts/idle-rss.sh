#!/usr/bin/env bash
# Idle resident memory of one kvpipe app: `infra/scripts/idle-rss.sh processor|analytics [port]`.
# Starts the app on a fresh state directory and an empty events topic of the local broker (started
# if needed), waits until /health answers plus 20 s of idling, prints VmRSS and stops the app. The
# README's RSS figures come from this script.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
app=${1:?usage: idle-rss.sh processor|analytics [port]}
port=${2:-16099}
py="$("$here/infra/scripts/venv.sh")/bin/python"
cd "$here"
"$py" -m kvpipe infra up >/dev/null  # the local broker (a running one is reused)
bootstrap=$("$py" -c "from kvpipe.schemas.settings import load_settings; print(load_settings().bootstrap())")
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
export KVPIPE_KAFKA_BOOTSTRAP=$bootstrap KVPIPE_STATE_DIR=$state KVPIPE_EVENTS_TOPIC=kvpipe-idle-rss-$app \
       KVPIPE_WEB_PORT=$port KVPIPE_ANALYTICS_WEB_PORT=$port
"$py" -m kvpipe infra up >/dev/null  # with a bootstrap set: only provisions this run's topics
"$py" -m kvpipe "$app" >"$state/app.log" 2>&1 &
pid=$!
for _ in $(seq 120); do
  if "$py" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
       "http://127.0.0.1:$port/health" 2>/dev/null; then break; fi
  kill -0 "$pid" 2>/dev/null || { echo "kvpipe $app exited; its log:" >&2; cat "$state/app.log" >&2; exit 1; }
  sleep 1
done
sleep 20
echo "kvpipe $app idle RSS: $(awk '/VmRSS/ {printf "%.0f MB", $2 / 1024}' "/proc/$pid/status")"
kill "$pid"
wait "$pid" 2>/dev/null || true
