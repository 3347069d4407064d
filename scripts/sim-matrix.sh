#!/usr/bin/env bash
# The fleet simulator's matrix: SEEDS seeds (matrix-1 … matrix-SEEDS) × the
# chaos levels none, light and heavy, at NODES nodes for DURATION of
# simulated workload (then the default settle). The three levels run in
# parallel; each run prints one line, a violation also the command that
# reproduces it; then a summary of the runs actually done. Exits 1 when any
# run broke an invariant, a level died or a run is missing.
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
		printf '%-5s %-10s violations=%s wallMs=%s commands=%s succeeded=%s digest=%s\n' "$chaos" "$seed" \
			"$(field violations "$out")" "$(field wallMs "$out")" "$(field total "$out")" "$(field succeeded "$out")" \
			"$(field digest "$out")"
		echo "$seed" >>"$tmp/$chaos.done"
		if ((rc != 0)); then
			echo "FAIL  reproduce: better-compute sim --seed $seed --nodes $nodes --duration $duration --chaos $chaos --log sim.log"
			sed 's/^/      /' "$tmp/$chaos.err"
			echo fail >>"$tmp/$chaos.failed"
		fi
	done
}

declare -A pids
for chaos in none light heavy; do
	level "$chaos" >"$tmp/$chaos.out" &
	pids[$chaos]=$!
done
# Wait on each level: one that died (a crash of the script's own loop, a
# kill) counts as a failure, beside its runs that failed.
failed=0
runs=0
for chaos in none light heavy; do
	rc=0
	wait "${pids[$chaos]}" || rc=$?
	cat "$tmp/$chaos.out"
	if ((rc != 0)); then
		echo "FAIL  level $chaos died (exit $rc)"
		failed=$((failed + 1))
	fi
	if [[ -f $tmp/$chaos.failed ]]; then
		failed=$((failed + $(wc -l <"$tmp/$chaos.failed")))
	fi
	if [[ -f $tmp/$chaos.done ]]; then
		runs=$((runs + $(wc -l <"$tmp/$chaos.done")))
	fi
done
echo "sim-matrix: $runs of $((3 * seeds)) runs done ($seeds seeds × none, light, heavy; $nodes nodes, $duration): $failed failed"
((failed == 0 && runs == 3 * seeds))
