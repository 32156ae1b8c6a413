source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call75.sh $OUT/
mkdir -p /tmp/res
NCCL_P2P_DISABLE=1 timeout 220 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 20 21 22 --steps 5 --warmup 2 --out /tmp/res/accuracy-slow.json > /tmp/res/accuracy-slow.log 2>&1
echo "slow rc=$?"
timeout 200 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 20 21 22 --steps 5 --warmup 2 --out /tmp/res/accuracy-nvlink.json > /tmp/res/accuracy-nvlink.log 2>&1
echo "nvlink rc=$?"
for f in /tmp/res/*.log; do echo "== $f"; grep -v "Warning\|warn(" $f | grep "|\|rror\|Traceback" | tail -12; done
tar czf $OUT/call75.tgz -C /tmp/res .
