source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call73.sh $OUT/
mkdir -p /tmp/res
C="--cases layer --hidden 4096,8192 --tokens 8K --repeats 3 --warmup 2 --no-overlap --no-check --variants megatron-sp,ring-interleaved --trace-dir /tmp/res/traces"
NCCL_P2P_DISABLE=1 timeout 120 torchrun --nproc_per_node 2 bench/layers.py $C --label slow --out /tmp/res/slow.json > /tmp/res/slow.log 2>&1
echo "slow rc=$?"
timeout 120 torchrun --nproc_per_node 2 bench/layers.py $C --label nvlink --out /tmp/res/nvlink.json > /tmp/res/nvlink.log 2>&1
echo "nvlink rc=$?"
rm -f /tmp/res/traces/*rank-1*
for f in /tmp/res/*.log; do echo "== $f"; grep "^| slow\|^| nvlink\|rror" $f | tail -4; done
python3 bench/timeline.py /tmp/res/traces/*rank-0.json.gz > /tmp/res/timeline.txt 2>&1
grep -v "^    busy  \|host-late" /tmp/res/timeline.txt | head -c 3000
tar czf $OUT/call73.tgz -C /tmp/res .
