source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call80.sh $OUT/
mkdir -p /tmp/res
F="--cases layer --hidden 8192 --tokens 8K,16K --repeats 5 --warmup 2 --no-overlap --variants megatron-sp,ring-interleaved"
for v in old both mlp attn; do
  P=$PWD; [ $v = both ] || P=$PWD/.gpu/v/$v:$PWD
  PYTHONPATH=$P:/tmp/site NCCL_P2P_DISABLE=1 timeout 60 torchrun --nproc_per_node 2 bench/layers.py $F --label slow-$v --out /tmp/res/slow-$v.json > /tmp/res/slow-$v.log 2>&1
  echo "$v rc=$?"; grep "^| slow" /tmp/res/slow-$v.log | grep -v "PASS\|link | block"
done
tar czf $OUT/call80.tgz -C /tmp/res .
