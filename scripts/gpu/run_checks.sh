#!/usr/bin/env bash
# Every GPU check in one call, inside a time budget (a lent GPU machine is short of time):
#   A. correctness: the whole test suite (default, slow and gpu tests) with CUDA visible, in
#      shards of two cores each, all at once (every test whose runtime.device is "auto" runs on
#      CUDA in bf16);
#   B. timings, one at a time: the bf16 matmul ceiling, every paper's device-hours
#      (scripts/gpu/paper_costs.py), `fpbench bench` at ViT-B/16, a paper-sized SGPT run
#      (scripts/gpu/paper_run.py), the official SGPT code next to fpbench
#      (tests/peer/sgpt_side_by_side.py) and `fpbench estimate` of the paper run's cell and of
#      one shape of each backbone family.
# Usage, from the repository root, with CUDA:
#   OUT=DIR BUDGET_S=520 PEER=path/to/SGPT PEER_SCRIPTS=path/to/peer-sgpt scripts/gpu/run_checks.sh
# STEPS="tests paper-run ..." runs only those steps (default: all); TESTS="tests/test_x.py -k y"
# narrows step tests to what pytest collects from those arguments; PAPER_ROUNDS (default 10)
# sets the paper run's rounds and PAPER_ARGS its other options (e.g. "--precision bf16-frozen
# --compile"); COSTS_CAP_S (default 300) caps the paper costs; SIDE_ROUNDS (default 5) and
# SIDE_PRECISIONS (default "bf16 fp32") set the side by side; ESTIMATE_SUITES and ESTIMATE_CAP_S (default 75) the suites whose
# first shape step estimate measures, and its cap for each.
# Each step is cut at its cap (or at the budget); DIR gets summary.txt, the JSON figures and
# logs.tgz (one log per step). Without PEER the side-by-side is skipped. The H200 figures in the
# README's speed section came from it.
# On a GPU machine with no package index (as the H200 was), first install what its image lacks
# from wheels downloaded elsewhere into a git-ignored .whl/ (`pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl ...`: pydantic,
# pydantic_core, annotated-types, typing-inspection, open_clip_torch, ftfy, wcwidth, SQLAlchemy,
# submitit, ml_collections), then `python3 -m pip install --no-index --no-deps .whl/*.whl` and
# `python3 -m pip install --no-index --no-deps --no-build-isolation -e .`.
set -u
OUT=${OUT:-/tmp/fpbench-gpu-checks}
mkdir -p "$OUT/logs"
END=$(($(date +%s) + ${BUDGET_S:-520}))
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
STEPS=${STEPS:-tests matmul paper-costs bench paper-run paper-run-nondet side-by-side estimate-sgpt estimate}
want() { [[ " $STEPS " == *" $1 "* ]]; }

step() { # step NAME CAP_S CMD...: CMD's output to logs/NAME.log, cut at CAP_S or the budget
  local name=$1 cap=$2 left t0 rc
  shift 2
  left=$((END - $(date +%s)))
  ((cap > left)) && cap=$left
  if ((cap < 15)); then
    echo "$name: skipped, budget spent" >>"$OUT/summary.txt"
    return
  fi
  t0=$(date +%s)
  timeout -k 5 "$cap" "$@" >"$OUT/logs/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $(($(date +%s) - t0)) s (cap $cap s)" >>"$OUT/summary.txt"
}

MATMUL='import torch
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(3):
    a @ b
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(20):
    a @ b
end.record()
torch.cuda.synchronize()
print(f"bf16 8192^3 matmul: {20 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3) / 1e12:.0f} TFLOP/s")
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv >"$OUT/logs/env.log" 2>&1
nproc >>"$OUT/logs/env.log"

# A. correctness: the tests dealt round-robin into shards (order kept, so a module's fixture
# is built at most once per shard), two cores each
if want tests; then
  # shellcheck disable=SC2086  # TESTS holds several pytest arguments
  $PY -m pytest --collect-only -q -p no:cacheprovider -m "not pretrained" ${TESTS:-} 2>/dev/null |
    grep '::' >"$OUT/logs/test-ids.txt"
  shards=$(($(nproc) / 2))
  for ((k = 0; k < shards; k++)); do
    awk -v n=$shards -v k=$k 'NR % n == k' "$OUT/logs/test-ids.txt" >"$OUT/logs/shard-$k.txt"
    [[ -s $OUT/logs/shard-$k.txt ]] || continue
    step "tests-$k" 240 taskset -c $((2 * k)),$((2 * k + 1)) xargs -a "$OUT/logs/shard-$k.txt" \
      -d '\n' $PY -m pytest -q -rfE -p no:cacheprovider -m "not pretrained" &
  done
  wait
fi

# B. timings, alone on the machine
want matmul && step matmul 30 $PY -c "$MATMUL"
if want paper-costs; then # measuring stops 40 s before the cap, to leave time for the sums
  cap=${COSTS_CAP_S:-300}
  step paper-costs "$cap" $PY scripts/gpu/paper_costs.py --device cuda --budget-s $((cap - 40)) \
    --json "$OUT/paper-costs.json"
fi
want bench && step bench 100 $PY -m fpbench bench --backbone vit-b16-in21k --device cuda \
  --precision bf16 --clients 5 --batch 40 --steps 8 --json "$OUT/bench.json"
# shellcheck disable=SC2086  # PAPER_ARGS holds several options
want paper-run && step paper-run 140 $PY scripts/gpu/paper_run.py --rounds "${PAPER_ROUNDS:-10}" \
  ${PAPER_ARGS:-} --scratch /tmp/paper-run --json "$OUT/paper-run.json"
want paper-run-nondet && step paper-run-nondet 80 $PY scripts/gpu/paper_run.py --rounds 6 \
  --scratch /tmp/paper-run --no-deterministic --json "$OUT/paper-run-nondet.json"
if want side-by-side && [[ -n ${PEER:-} ]]; then
  # shellcheck disable=SC2086  # SIDE_PRECISIONS holds several precisions
  step side-by-side 160 $PY tests/peer/sgpt_side_by_side.py --peer "$PEER" \
    --peer-scripts "$PEER_SCRIPTS" --setting vit-b16 --rounds "${SIDE_ROUNDS:-5}" --device cuda \
    --precision ${SIDE_PRECISIONS:-bf16 fp32} --scratch /tmp/side-by-side \
    --json "$OUT/side-by-side.json"
fi
# the paper run's cell (sgpt-table1's 2nd SGPT shape), then one shape of iNat (the largest
# images), CLIP, PEP-FedPT and SDFed
want estimate-sgpt && step estimate-sgpt 120 $PY -m fpbench estimate --suite sgpt-table1 \
  --method sgpt --max-shapes 2 --device cuda --json "$OUT/estimate-sgpt.json"
if want estimate; then
  for suite in ${ESTIMATE_SUITES:-pep-table2 clip-fewshot pep-table1 sdfed-sweeps}; do
    step "estimate-$suite" "${ESTIMATE_CAP_S:-75}" $PY -m fpbench estimate --suite "$suite" \
      --max-shapes 1 --rounds 1 --device cuda --json "$OUT/estimate-$suite.json"
  done
fi

cd "$OUT/logs" || exit 1
for log in env matmul paper-run paper-run-nondet side-by-side bench estimate-*; do
  [[ -f ${log%.log}.log ]] && echo "== ${log%.log}" && tail -n 14 "${log%.log}.log" | cut -c1-160
done
[[ -f paper-costs.log ]] && echo "== paper-costs" && grep -A40 "^device-hours" paper-costs.log
if [[ -f test-ids.txt ]]; then
  echo "== tests ($(wc -l <test-ids.txt))"
  grep -hE "^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped)" tests-*.log | cut -c1-200
fi
cd "$OUT" && tar -czf logs.tgz logs && rm -rf logs
echo "== summary" && cat summary.txt
