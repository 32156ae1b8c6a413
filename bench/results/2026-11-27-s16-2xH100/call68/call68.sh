source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/card.txt
cp .gpu/call68.sh $OUT/
mkdir -p /tmp/res
C="--cases layer --hidden 4096,8192 --tokens 8K,16K,32K --repeats 5 --warmup 2 --no-overlap --variants megatron-sp,no-comm,ring,ring-linear,ring-interleaved"
NCCL_P2P_DISABLE=1 timeout 260 torchrun --nproc_per_node 2 bench/layers.py $C --label slow --out /tmp/res/layers-slow-layer.json > /tmp/res/layers-slow-layer.log 2>&1
echo "slow rc=$?"
timeout 260 torchrun --nproc_per_node 2 bench/layers.py $C --label nvlink --out /tmp/res/layers-nvlink-layer.json > /tmp/res/layers-nvlink-layer.log 2>&1
echo "nvlink rc=$?"
for f in /tmp/res/*.log; do echo "== $f"; grep -v "Warning\|warnings.warn\|^{" $f | grep "|\|rror\|Traceback" | tail -45; done
tar czf $OUT/call68.tgz -C /tmp/res .
