#!/usr/bin/env bash
# The code cites the repo's own design, docs/architecture.md: never a design
# document outside the repo ("DESIGN §N"), and only invariants that page
# defines (a "**In — …**" entry of its Invariants section).
set -euo pipefail
cd "$(dirname "$0")/.."
files() { git ls-files -- '*.go' '*.sql' '*.sh' '*.proto' '*.md' Makefile ':!api/gen/*' ':!scripts/lint-docs.sh'; }
fail=0
if hits=$(files | xargs grep -n 'DESIGN §' 2>/dev/null); then
	echo "cite docs/architecture.md, not DESIGN §N:"
	echo "$hits"
	fail=1
fi
defined=$(grep -oE '^\- \*\*I[0-9]+ ' docs/architecture.md | grep -oE 'I[0-9]+' | sort -u)
for inv in $(files | xargs grep -ohE '\bI[0-9]+\b' 2>/dev/null | sort -u); do
	if ! grep -qx "$inv" <<<"$defined"; then
		echo "invariant $inv is cited but not defined in docs/architecture.md:"
		files | xargs grep -nw "$inv" | head -5
		fail=1
	fi
done
exit $fail
