source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call90.sh $OUT/
OLD="PYTHONPATH=$PWD/.gpu/v/old:$PYTHONPATH"
T="--hidden 512 --head-dim 64 --tokens 4K --seq 2048 --no-overlap --repeats 50 --warmup 5"
# host time per layer / MLP block (tiny shapes: the GPU waits for the host), before and after
env $OLD timeout 100 torchrun --nproc_per_node 2 bench/layers.py --cases layer,mlp $T --no-check --variants megatron-sp,ring,ring-linear --label before --out $OUT/tiny-before.json > $OUT/tiny-before.log 2>&1
echo "tiny before rc=$?"; grep "| before" $OUT/tiny-before.log
timeout 100 torchrun --nproc_per_node 2 bench/layers.py --cases layer,mlp $T --variants megatron-sp,ring,ring-linear --label after --out $OUT/tiny-after.json > $OUT/tiny-after.log 2>&1
echo "tiny after (with checks) rc=$?"; grep "| after\|check\|FAIL" $OUT/tiny-after.log | tail -12
# whole model: Megatron, the two passes (new), the two passes (before)
timeout 130 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 20 23 --steps 4 --warmup 2 --out $OUT/accuracy-after.json > $OUT/accuracy-after.log 2>&1
echo "whole after rc=$?"; grep "| gpt" $OUT/accuracy-after.log
env $OLD timeout 100 torchrun --nproc_per_node 2 bench/planner_accuracy.py --only 23 --steps 4 --warmup 2 --out $OUT/accuracy-before.json > $OUT/accuracy-before.log 2>&1
echo "whole before rc=$?"; grep "| gpt" $OUT/accuracy-before.log
