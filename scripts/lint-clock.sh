#!/usr/bin/env bash
# The one-clock rule (docs/architecture.md, "Services"): time comes from pkg/clock only, so that the
# simulator can drive the same code. Fails on any read of the wall clock, sleep
# or timer outside pkg/clock and generated code, tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
pattern='time\.(Now|Since|Until|Sleep|After|AfterFunc|Tick|NewTimer|NewTicker)\('
if hits=$(grep -rnE --include='*.go' "$pattern" . | grep -vE '^\./(pkg/clock/|api/gen/|tools/|bin/)'); then
	echo "time read outside pkg/clock (use a clock.Clock):"
	echo "$hits"
	exit 1
fi
