source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call74.sh $OUT/
mkdir -p /tmp/res
F="--cases layer --hidden 4096,8192 --tokens 8K,16K,32K --repeats 5 --warmup 2 --no-overlap --variants megatron-sp,no-comm,ring,ring-linear,ring-interleaved,ring-interleaved-4"
NCCL_P2P_DISABLE=1 timeout 200 torchrun --nproc_per_node 2 bench/layers.py $F --label slow --out /tmp/res/slow.json > /tmp/res/slow.log 2>&1
echo "slow rc=$?"
timeout 200 torchrun --nproc_per_node 2 bench/layers.py $F --label nvlink --out /tmp/res/nvlink.json > /tmp/res/nvlink.log 2>&1
echo "nvlink rc=$?"
C="--cases layer --hidden 4096,8192 --tokens 8K --repeats 3 --warmup 2 --no-overlap --no-check --variants ring-interleaved --trace-dir /tmp/res/traces"
NCCL_P2P_DISABLE=1 timeout 100 torchrun --nproc_per_node 2 bench/layers.py $C --label slow --out /tmp/res/trace-slow.json > /tmp/res/trace-slow.txt 2>&1
rm -f /tmp/res/traces/*rank-1*
python3 bench/timeline.py /tmp/res/traces/*rank-0.json.gz > /tmp/res/timeline.txt 2>&1
for f in /tmp/res/*.log; do echo "== $f"; grep "^| slow\|^| nvlink\|rror\|FAIL" $f | grep -v "PASS\|n/a\|megatron-sp\|ring-linear" | tail -24; done
grep -v "^    busy  \|host-late" /tmp/res/timeline.txt | head -c 1500
tar czf $OUT/call74.tgz -C /tmp/res .
