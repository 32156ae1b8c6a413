source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call88.sh $OUT/
timeout 200 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 20 23 --steps 2 --warmup 2 --profile > $OUT/profile.log 2>&1
echo "rc=$?"
grep -v "Warn\|warn" $OUT/profile.log | grep "| gpt\|FAILED\|Error" | tail -4
