source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call92.sh .gpu/hosttrace.py .gpu/hoststats.py $OUT/
mkdir -p /tmp/ht; rm -f /tmp/ht/*
timeout 150 torchrun --nproc_per_node 2 .gpu/hosttrace.py --cases layer --hidden 512 --head-dim 64 --tokens 4K --seq 2048 --no-check --no-overlap --variants megatron-sp,ring-linear --repeats 20 --warmup 3 --trace-dir /tmp/ht > $OUT/hosttrace.log 2>&1
echo "rc=$?"; grep "| default" $OUT/hosttrace.log
for v in megatron-sp ring-linear; do cp /tmp/ht/host-layer-512-4096-$v-rank-0.json.gz $OUT/; echo "== $v"; python3 .gpu/hoststats.py /tmp/ht/host-layer-512-4096-$v-rank-0.json.gz 45 | cut -c1-150; done
