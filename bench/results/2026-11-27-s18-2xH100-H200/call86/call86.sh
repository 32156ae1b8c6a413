source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call86.sh $OUT/
timeout 200 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 20 23 21 --steps 4 --warmup 2 --trace-dir $OUT/trace-nvlink --out $OUT/accuracy-nvlink.json > $OUT/accuracy-nvlink.log 2>&1
echo "nvlink rc=$?"
grep -v "Warn\|warn" $OUT/accuracy-nvlink.log | grep "|\|FAILED\|Error" | tail -8
python3 bench/timeline.py $OUT/trace-nvlink/case-*-rank-0.json.gz > $OUT/timeline-nvlink.txt 2>&1; head -c 5000 $OUT/timeline-nvlink.txt
NCCL_P2P_DISABLE=1 timeout 220 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 20 23 21 --steps 4 --warmup 2 --trace-dir $OUT/trace-slow --out $OUT/accuracy-slow.json > $OUT/accuracy-slow.log 2>&1
echo "slow rc=$?"
grep -v "Warn\|warn" $OUT/accuracy-slow.log | grep "|\|FAILED\|Error" | tail -8
python3 bench/timeline.py $OUT/trace-slow/case-*-rank-0.json.gz > $OUT/timeline-slow.txt 2>&1; head -c 3000 $OUT/timeline-slow.txt
