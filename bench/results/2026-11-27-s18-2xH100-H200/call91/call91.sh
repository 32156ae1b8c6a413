source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call91.sh $OUT/
timeout 120 torchrun --nproc_per_node 2 bench/host_issue.py --iters 2000 > $OUT/host_issue.log 2>&1
echo "rc=$?"; grep "|" $OUT/host_issue.log; grep -i "error" $OUT/host_issue.log | head -5
