source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call78.sh $OUT/
mkdir -p /tmp/res
F="--cases layer --hidden 4096,8192 --tokens 8K,16K,32K --repeats 5 --warmup 2 --no-overlap --variants megatron-sp,no-comm,ring,ring-interleaved,ring-interleaved-4"
NCCL_P2P_DISABLE=1 timeout 125 torchrun --nproc_per_node 2 bench/layers.py $F --label slow --out /tmp/res/slow.json > /tmp/res/slow.log 2>&1
echo "slow rc=$?"
timeout 115 torchrun --nproc_per_node 2 bench/layers.py $F --label nvlink --out /tmp/res/nvlink.json > /tmp/res/nvlink.log 2>&1
echo "nvlink rc=$?"
for f in /tmp/res/*.log; do echo "== $f"; grep "^| slow\|^| nvlink\|rror\|FAIL" $f | grep -v "PASS\|n/a\|megatron-sp\|no-comm\|link | block" | tail -22; done
tar czf $OUT/call78.tgz -C /tmp/res .
