#!/usr/bin/env bash
# Waits until the compose stack's N fakedaemons are adopted, then prints the
# environment for the CLI (also written to .better-compute/compose.env).
# Usage: scripts/wait-fleet.sh N [TIMEOUT_SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
want=${1:-8}
timeout=${2:-180}
if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
cli=bin/linux/better-compute

start=$SECONDS
# The bootstrap one-shot writes the root credentials (mode 0600) into the
# secrets volume, which only it mounts; docker cp reads them as root.
env_file=.better-compute/compose.env
mkdir -p .better-compute
umask 077 # the file holds the root token
until id=$("${compose[@]}" ps -q bootstrap 2>/dev/null) && [[ -n $id ]] &&
	docker cp "$id:/var/lib/better-compute/secrets/root.env" - 2>/dev/null | tar -xO >"$env_file.tmp" 2>/dev/null &&
	[[ -s $env_file.tmp ]]; do
	if ((SECONDS - start > timeout)); then
		echo "bootstrap did not write its credentials within ${timeout}s:" >&2
		"${compose[@]}" logs --tail 30 bootstrap >&2 || true
		exit 1
	fi
	sleep 1
done
mv "$env_file.tmp" "$env_file"
port=${BETTER_COMPUTE_API_PORT:-8080}
echo "export BETTER_COMPUTE_URL=http://127.0.0.1:$port" >>"$env_file"
# shellcheck disable=SC1090
source "$env_file"
export BETTER_COMPUTE_URL BETTER_COMPUTE_TOKEN BETTER_COMPUTE_TENANT

adopted=0
revoked=0
while :; do
	# Adopted nodes with a live session: machines removed by a scale-down
	# stay adopted in the database but hold no session. A revoked node's
	# machine may still run but never gets a session again: it counts as
	# settled, so that FLEET=N after a revocation does not wait forever.
	read -r adopted revoked < <("$cli" nodes list -o json 2>/dev/null | awk '
		/^  \{/ { s = 0; g = 0; r = 0 }
		/"state": *"adopted"/ { s = 1 }
		/"gateway": *"[^"]+"/ { g = 1 }
		/"revokedAt": *"/ { r = 1 }
		/^  \}/ { if (r) k++; else if (s && g) n++ }
		END { print n + 0, k + 0 }' || echo 0 0)
	if ((adopted + revoked >= want)); then break; fi
	if ((SECONDS - start > timeout)); then
		echo "only $adopted of $want nodes adopted after ${timeout}s ($revoked revoked)" >&2
		"$cli" nodes list >&2 || true
		exit 1
	fi
	sleep 1
done
if ((revoked > 0)); then
	echo "note: $revoked revoked node(s) counted as settled: a revoked machine never gets a session again" >&2
fi
echo "$adopted nodes adopted in $((SECONDS - start))s"
"$cli" nodes list
echo
echo "The CLI's environment (source $env_file):"
cat "$env_file"
