source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call94.sh $OUT/
OLD="PYTHONPATH=$PWD/.gpu/v/old:$PYTHONPATH"
env $OLD timeout 55 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 23 --steps 5 --warmup 2 --out $OUT/accuracy-before.json > /tmp/accuracy-before.log 2>&1
echo "whole before rc=$?"; grep "| gpt" /tmp/accuracy-before.log
timeout 55 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 23 --steps 5 --warmup 2 --out $OUT/accuracy-after.json > /tmp/accuracy-after.log 2>&1
echo "whole after rc=$?"; grep "| gpt" /tmp/accuracy-after.log
