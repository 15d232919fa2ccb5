#!/usr/bin/env bash
# Scaling benchmark grid (fpbench/measure/scaling.py): each (method, clients) once with this
# worktree's code and, where OLD_PY is set (e.g. /work/main/.venv/bin/python), once with that
# interpreter's fpbench, interleaved on the same load; one thread each. One JSON line a run,
# tagged "code": "new" / "old". Usage: scripts/scaling_bench.sh OUT.jsonl "10 100 1000" [methods]
set -uo pipefail
out=${1:?usage: scaling_bench.sh OUT.jsonl "CLIENTS" [METHODS]}
grid=${2:-"10 100 1000"}
methods=${3:-"fedvpt fedvpt-d fedrep pep-fedpt fedem pfedhn"}
here=$(cd "$(dirname "$0")/.." && pwd)
new_py=${NEW_PY:-python}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for n in $grid; do
  for m in $methods; do
    for code in new old; do
      py=$new_py
      if [ "$code" = old ]; then
        [ -n "${OLD_PY:-}" ] || continue
        py=$OLD_PY
      fi
      line=$(timeout "${LIMIT_S:-1800}" "$py" "$here/fpbench/measure/scaling.py" --method "$m" \
        --clients "$n" ${EXTRA:-} 2>/dev/null | tail -1)
      [ -n "$line" ] || line="{\"method\": \"$m\", \"clients\": $n, \"timed_out\": true}"
      echo "{\"code\": \"$code\", ${line#\{}" | tee -a "$out"
    done
  done
done
