#!/usr/bin/env bash
# The fleet simulator's matrix: SEEDS seeds (matrix-1 … matrix-SEEDS) × the
# chaos levels none, light and heavy, at NODES nodes for DURATION of
# simulated workload (then the default settle). The three levels run in
# parallel; each run prints one line, a violation also the command that
# reproduces it; then a summary. Exits 1 when any run broke an invariant.
# Usage: SEEDS=20 NODES=200 DURATION=10m scripts/sim-matrix.sh
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=${SEEDS:-20}
nodes=${NODES:-200}
duration=${DURATION:-10m}
GO=${GO:-go}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bin=$tmp/better-compute
$GO build -o "$bin" ./cmd/better-compute

field() { sed -n "s/^ *\"$1\": \"\{0,1\}\([^\",]*\)\"\{0,1\},\{0,1\}\$/\1/p" <<<"$2"; }

level() {
	local chaos=$1 i seed out rc
	for ((i = 1; i <= seeds; i++)); do
		seed=matrix-$i
		rc=0
		out=$("$bin" sim --seed "$seed" --nodes "$nodes" --duration "$duration" --chaos "$chaos" 2>"$tmp/$chaos.err") || rc=$?
		printf '%-5s %-10s violations=%s wallMs=%s commands=%s digest=%s\n' "$chaos" "$seed" \
			"$(field violations "$out")" "$(field wallMs "$out")" "$(field total "$out")" "$(field digest "$out")"
		if ((rc != 0)); then
			echo "FAIL  reproduce: better-compute sim --seed $seed --nodes $nodes --duration $duration --chaos $chaos --log sim.log"
			sed 's/^/      /' "$tmp/$chaos.err"
			echo fail >>"$tmp/$chaos.failed"
		fi
	done
}

for chaos in none light heavy; do
	level "$chaos" >"$tmp/$chaos.out" &
done
wait
failed=0
for chaos in none light heavy; do
	cat "$tmp/$chaos.out"
	if [[ -f $tmp/$chaos.failed ]]; then
		failed=$((failed + $(wc -l <"$tmp/$chaos.failed")))
	fi
done
runs=$((3 * seeds))
echo "sim-matrix: $runs runs ($seeds seeds × none, light, heavy; $nodes nodes, $duration): $failed failed"
((failed == 0))
