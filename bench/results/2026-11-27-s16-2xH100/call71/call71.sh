source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call71.sh $OUT/
mkdir -p /tmp/res
F="--cases layer --hidden 4096,8192 --tokens 8K,16K,32K --repeats 5 --warmup 2 --no-overlap --variants megatron-sp,no-comm,ring,ring-interleaved"
NCCL_P2P_DISABLE=1 timeout 150 torchrun --nproc_per_node 2 bench/layers.py $F --label slow --out /tmp/res/slow.json > /tmp/res/slow.log 2>&1
echo "slow rc=$?"
timeout 150 torchrun --nproc_per_node 2 bench/layers.py $F --label nvlink --out /tmp/res/nvlink.json > /tmp/res/nvlink.log 2>&1
echo "nvlink rc=$?"
G="--cases mlp,layer --hidden 4096,8192 --tokens 8K --repeats 5 --warmup 2 --no-overlap --no-check --variants megatron-sp,ring"
NCCL_MIN_P2P_NCHANNELS=16 NCCL_P2P_DISABLE=1 timeout 80 torchrun --nproc_per_node 2 bench/layers.py $G --label slow-p2pch16 --out /tmp/res/slow-p2pch16.json > /tmp/res/slow-p2pch16.log 2>&1
echo "slow p2p16 rc=$?"
NCCL_MIN_P2P_NCHANNELS=16 timeout 80 torchrun --nproc_per_node 2 bench/layers.py $G --label nvlink-p2pch16 --out /tmp/res/nvlink-p2pch16.json > /tmp/res/nvlink-p2pch16.log 2>&1
echo "nvlink p2p16 rc=$?"
for f in /tmp/res/*.log; do echo "== $f"; grep "^| slow\|^| nvlink\|rror\|FAIL" $f | grep -v PASS | tail -26; done
tar czf $OUT/call71.tgz -C /tmp/res .
