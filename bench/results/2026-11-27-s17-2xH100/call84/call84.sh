source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call84.sh $OUT/
mkdir -p /tmp/res
F="--cases mlp,layer --hidden 4096,8192 --tokens 8K,16K,32K --repeats 5 --warmup 2 --no-overlap --variants megatron-sp,no-comm,ring,ring-linear"
timeout 170 torchrun --nproc_per_node 2 bench/layers.py $F --label nvlink --out /tmp/res/nvlink.json > /tmp/res/nvlink.log 2>&1
echo "nvlink rc=$?"
PYTHONPATH=$PWD/.gpu/v/old:$PWD:/tmp/site timeout 60 torchrun --nproc_per_node 2 bench/layers.py --cases layer --hidden 4096,8192 --tokens 8K,16K,32K --repeats 5 --warmup 2 --no-overlap --variants megatron-sp,ring-linear --label nvlink-before --out /tmp/res/nvlink-before.json > /tmp/res/nvlink-before.log 2>&1
echo "nvlink-before rc=$?"
NCCL_P2P_DISABLE=1 timeout 150 torchrun --nproc_per_node 2 bench/layers.py $F --label slow --out /tmp/res/slow.json > /tmp/res/slow.log 2>&1
echo "slow rc=$?"
for f in /tmp/res/*.log; do grep "^| nvlink\|^| slow" $f | grep -v "PASS\|link | block\|no-comm"; grep -c FAIL $f; done
tar czf $OUT/call84.tgz -C /tmp/res .
