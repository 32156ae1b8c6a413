source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call87.sh $OUT/
rm -rf /tmp/res; mkdir -p /tmp/res
run() { # label, DS_STPAR_P2P_IN_FLIGHT value, case indices...
  label=$1; inflight=$2; shift 2
  DS_STPAR_P2P_IN_FLIGHT=$inflight timeout 150 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only "$@" --steps 4 --warmup 2 --trace-dir /tmp/res/trace-$label --out /tmp/res/accuracy-$label.json > /tmp/res/accuracy-$label.log 2>&1
  echo "$label rc=$?"
  grep -v "Warn\|warn" /tmp/res/accuracy-$label.log | grep "| gpt\|FAILED\|Error" | tail -4
  python3 bench/timeline.py /tmp/res/trace-$label/case-*-rank-0.json.gz /tmp/res/trace-$label/case-*-rank-1.json.gz > /tmp/res/timeline-$label.txt 2>&1
  grep "json.gz" /tmp/res/timeline-$label.txt
}
run default 8 20 23
run inflight0 0 23
run inflight32 32 23
tar czf $OUT/call87.tgz -C /tmp/res .
