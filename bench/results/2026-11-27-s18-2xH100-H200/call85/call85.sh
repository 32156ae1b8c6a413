source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call85.sh $OUT/
timeout 170 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 6 7 19 --steps 4 --warmup 2 --out $OUT/accuracy_nvlink.json > $OUT/accuracy_nvlink.log 2>&1
echo "nvlink rc=$?"
grep -v "Warn\|warn" $OUT/accuracy_nvlink.log | grep "|\|case\|Error" | tail -20
NCCL_P2P_DISABLE=1 timeout 170 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 6 7 19 --steps 4 --warmup 2 --out $OUT/accuracy_slow.json > $OUT/accuracy_slow.log 2>&1
echo "slow rc=$?"
grep -v "Warn\|warn" $OUT/accuracy_slow.log | grep "|\|case\|Error" | tail -20
