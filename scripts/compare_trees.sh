#!/usr/bin/env bash
# Same-call speed comparison of this tree against another commit's tree: a change meant to keep the
# speed (issue 24's reshaping) is checked on the same GPU in the same call, not against numbers of
# another day. Here, before the device call:
#   mkdir -p .kbench/tree_SHA && git archive SHA | tar -x -C .kbench/tree_SHA
# then on the device (carry .kbench and .whl):
#   bash scripts/compare_trees.sh .kbench/tree_SHA b06 b8 mixed grpo
# Workloads are docs/benchmarks.md's (dummy weights, no HF baseline). Each runs on both trees, the
# order alternating from one workload to the next (old first, then new first, ...) so that drift in
# the GPU's clocks does not favour one tree; each bench's tok/s is printed as it ends, a table last,
# and the reports and logs come back as one tar, $OUT/compare_trees.tar (a call returns 8 files at most).
set -uo pipefail
OLD=$(cd "$1" && pwd); shift
NEW=$PWD
source "$(dirname "$0")/device_env.sh"
RESULTS=/tmp/compare_trees && rm -rf $RESULTS && mkdir -p $RESULTS
Q06=$NEW/recipes/configs/qwen3-0.6b Q8=$NEW/recipes/configs/qwen3-8b  # both trees bench the same shapes
workload() {  # the bench arguments of one workload name
    case $1 in
    b06) echo "--model $Q06 --num-prompts 256 --input-len 256 --output-len 512" ;;
    b8) echo "--model $Q8 --num-prompts 256 --input-len 256 --output-len 512" ;;
    mixed) echo "--model $Q06 --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --temperature 0.6" ;;
    grpo) echo "--model $Q06 --num-prompts 64 --n 16 --input-len 512 --output-len 1024" ;;
    *) echo "unknown workload $1" >&2; return 1 ;;
    esac
}
bench_in() {  # TREE TAG NAME: one bench of workload NAME with TREE's code; its JSON to $OUT/NAME_TAG.json
    local tree=$1 tag=$2 name=$3 args
    args=$(workload "$name") || return
    mkdir -p "/tmp/compare_path_$tag" && ln -sfn "$tree/kernels" "/tmp/compare_path_$tag/rollout_kernels"
    echo "== $name, $tag tree ($tree)"
    # run from inside the tree: `python3 -m` puts the working directory first on the path
    (cd "$tree" && PYTHONPATH=$tree:/tmp/compare_path_$tag:/tmp/site COLUMNS=200 timeout 200 \
        python3 -m rollout_cli.cli.main bench --load-format dummy $args --json "$RESULTS/${name}_$tag.json" \
        > "$RESULTS/${name}_$tag.log" 2>&1) || tail -3 "$RESULTS/${name}_$tag.log"
    grep -E "output tok/s" "$RESULTS/${name}_$tag.log" | head -1
}
flip=0
for name in "$@"; do
    if [ $flip = 0 ]; then bench_in "$OLD" old "$name"; bench_in "$NEW" new "$name"
    else bench_in "$NEW" new "$name"; bench_in "$OLD" old "$name"; fi
    flip=$((1 - flip))
done
python3 - "$RESULTS" "$@" <<'EOF'
import json, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
def report(name, tag):
    path = out / f"{name}_{tag}.json"
    return json.loads(path.read_text()) if path.exists() else None
def tok_s(r):
    return r["rollout"]["output_tokens_per_s"] if r else None
print(f"{'workload':10} {'old tok/s':>12} {'new tok/s':>12} {'new/old':>8} {'new: of limit':>14} {'of roofline':>12}")
for name in names:
    old, new = report(name, "old"), report(name, "new")
    ratio = f"{tok_s(new) / tok_s(old):8.3f}" if old and new else "       -"
    limits = (new or {}).get("bandwidth", {})  # this tree's limits: the rule of issue 25 item 1
    print(f"{name:10} {tok_s(old) or 0:12,.1f} {tok_s(new) or 0:12,.1f} {ratio} "
          f"{limits.get('fraction_of_limit', 0):14.1%} {limits.get('fraction_of_roofline', 0):12.1%}")
EOF
tar -C $RESULTS -cf "$OUT/compare_trees.tar" .
