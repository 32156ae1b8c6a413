source .gpu/setup.sh > /dev/null 2>&1
cp .gpu/call89.sh $OUT/
T="--hidden 512 --head-dim 64 --tokens 4K --seq 2048 --no-check --no-overlap"
timeout 120 torchrun --nproc_per_node 2 bench/layers.py --cases layer,mlp $T --variants megatron-sp,ring,ring-linear --repeats 50 --warmup 5 --label tiny --out $OUT/tiny.json > $OUT/tiny.log 2>&1
echo "tiny rc=$?"; grep -v "Warn\|warn" $OUT/tiny.log | grep "|" | tail -12
for v in ring-linear megatron-sp; do
timeout 120 torchrun --nproc_per_node 2 --no-python .gpu/cprof.sh $OUT/cprof-$v bench/layers.py --cases layer $T --variants $v --repeats 300 --warmup 5 --label tiny > $OUT/cprof-$v.log 2>&1
echo "cprof $v rc=$?"
done
python3 -c "
import pstats,sys
for v in ['ring-linear','megatron-sp']:
    p=pstats.Stats('$OUT/cprof-'+v+'-rank-0.prof'); p.sort_stats('tottime').print_stats(25)
" 2>&1 | cut -c1-160 | head -90
