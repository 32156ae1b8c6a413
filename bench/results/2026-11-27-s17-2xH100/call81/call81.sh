source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call81.sh $OUT/
mkdir -p /tmp/res
F="--cases layer,mlp --hidden 4096,8192 --tokens 8K,16K --repeats 3 --warmup 2 --no-overlap --variants megatron-sp,ring,ring-linear --memory-trace"
timeout 150 torchrun --nproc_per_node 2 bench/layers.py $F --label nvlink --out /tmp/res/mem.json > /tmp/res/mem.log 2>&1
echo "rc=$?"
grep "^| nvlink" /tmp/res/mem.log | grep -v "PASS\|link | block"
tar czf $OUT/call81.tgz -C /tmp/res .
