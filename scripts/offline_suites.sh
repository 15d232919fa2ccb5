#!/usr/bin/env bash
# Run every offline suite (the shipped suites named smoke* or *-smoke: synthetic data and
# self-made or random backbones, nothing downloaded) into OUT_DIR/results.db, with a fresh
# fpbench cache in OUT_DIR/cache, using the `fpbench` on PATH (or $FPBENCH). Run it at two
# commits, with the same options, then compare:
#
#   scripts/offline_suites.sh /tmp/before --device cpu --threads 4     # at commit A
#   scripts/offline_suites.sh /tmp/after --device cpu --threads 4      # at commit B
#   fpbench db diff /tmp/before/results.db /tmp/after/results.db
#
# Options after OUT_DIR go to every `fpbench run` (stored values are bit-identical only among
# runs on the same device kind and thread count). OUT_DIR must be new or empty: nothing of
# another run's is reused. The suites are those the active fpbench ships (it runs inside OUT_DIR,
# so no ./benchmarks folder and no $FPBENCH_SUITES is read); OFFLINE_SUITES="smoke smoke-clip"
# runs only those.
set -euo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: $0 OUT_DIR [fpbench run options...]" >&2
  exit 2
fi
OUT=$1
shift
FPBENCH=$(command -v "${FPBENCH:-fpbench}") || { echo "no fpbench on PATH" >&2; exit 2; }
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then
  echo "$OUT is not empty: give a new or empty folder" >&2
  exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=$(head -1 "$FPBENCH" | sed -n 's/^#!//p')
cd "$OUT"
unset FPBENCH_SUITES
SUITES=${OFFLINE_SUITES:-$("${PYTHON:-python3}" -c '
import fnmatch
from fpbench.suites import list_suites
print(" ".join(s for s in list_suites() if fnmatch.fnmatch(s, "smoke*") or s.endswith("-smoke")))
')}
if [ -z "$SUITES" ]; then
  echo "no offline suites found (smoke*, *-smoke)" >&2
  exit 1
fi
export FPBENCH_CACHE="$OUT/cache"
echo "fpbench: $FPBENCH ($("$FPBENCH" --version))"
echo "suites: $SUITES"
for suite in $SUITES; do
  echo "== $suite"
  "$FPBENCH" run --suite "$suite" --db "$OUT/results.db" --checkpoint-dir "$OUT/checkpoints" \
    --job-dir "$OUT/jobs" --log-dir "$OUT/logs" "$@"
done
[ -f "$OUT/results.db" ] && "$FPBENCH" db check "$OUT/results.db"
echo "results: $OUT/results.db"
