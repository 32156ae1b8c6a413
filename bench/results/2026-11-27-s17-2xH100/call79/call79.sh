source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call79.sh $OUT/
mkdir -p /tmp/res/trace
F="--cases layer --hidden 8192 --tokens 8K --repeats 5 --warmup 2 --no-overlap --variants megatron-sp,no-comm,ring-interleaved"
NCCL_P2P_DISABLE=1 timeout 100 torchrun --nproc_per_node 2 bench/layers.py $F --label slow --trace-dir /tmp/res/trace --out /tmp/res/slow.json > /tmp/res/slow.log 2>&1
echo "slow rc=$?"
grep "^| slow" /tmp/res/slow.log | grep -v "PASS\|link | block"
ls -la /tmp/res/trace
tar czf $OUT/call79.tgz -C /tmp/res .
