source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call93.sh $OUT/
OLD="PYTHONPATH=$PWD/.gpu/v/old:$PYTHONPATH"
timeout 60 torchrun --nproc_per_node 2 bench/host_issue.py --iters 2000 > $OUT/host_issue.log 2>&1
echo "host_issue rc=$?"; grep "|" $OUT/host_issue.log
T="--hidden 512 --head-dim 64 --tokens 4K --seq 2048 --no-overlap --repeats 50 --warmup 5"
env $OLD timeout 60 torchrun --nproc_per_node 2 bench/layers.py --cases layer,mlp $T --no-check --variants megatron-sp,ring,ring-linear --label before --out $OUT/tiny-before.json > /tmp/tiny-before.log 2>&1
echo "tiny before rc=$?"; grep "| before" /tmp/tiny-before.log
timeout 80 torchrun --nproc_per_node 2 bench/layers.py --cases layer,mlp $T --variants megatron-sp,ring,ring-linear --label after --out $OUT/tiny-after.json > /tmp/tiny-after.log 2>&1
echo "tiny after (with checks) rc=$?"; grep "| after\|FAIL" /tmp/tiny-after.log | grep -v PASS
grep -c PASS /tmp/tiny-after.log
timeout 110 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 20 23 --steps 4 --warmup 2 --out $OUT/accuracy-after.json > /tmp/accuracy-after.log 2>&1
echo "whole after rc=$?"; grep "| gpt" /tmp/accuracy-after.log
env $OLD timeout 80 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 23 --steps 4 --warmup 2 --out $OUT/accuracy-before.json > /tmp/accuracy-before.log 2>&1
echo "whole before rc=$?"; grep "| gpt" /tmp/accuracy-before.log
L="--cases layer --hidden 4096 --tokens 8K,16K --no-overlap --variants megatron-sp,ring-linear,ring"
timeout 100 torchrun --nproc_per_node 2 bench/layers.py $L --label nvlink --out $OUT/layer-after.json > /tmp/layer-after.log 2>&1
echo "layer after rc=$?"; grep "| nvlink\|FAIL" /tmp/layer-after.log | grep -v PASS; grep -c PASS /tmp/layer-after.log
env $OLD timeout 80 torchrun --nproc_per_node 2 bench/layers.py $L --no-check --label nvlink-before --out $OUT/layer-before.json > /tmp/layer-before.log 2>&1
echo "layer before rc=$?"; grep "| nvlink" /tmp/layer-before.log
