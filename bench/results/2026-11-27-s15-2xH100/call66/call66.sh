source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
N=${N:-66}
cp .gpu/call$N.sh $OUT/; cp -r .gpu/s15b $OUT/
mkdir -p /tmp/res
T0=$(date +%s)
SEED=${SEED:-4321}
B="--gpus 2 --seq-len 65536 --global-batch-tokens 524288 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --model bench/models/llama-3b.json --gpu h100-80g --steps 4 --seed $SEED --label nvlink"
timeout 560 python3 bench/hotswitch.py $B --plans "" --config static=.gpu/s15b/static.json --config planned=.gpu/s15b/planned.json --config dp2-z1-mb1=.gpu/s15b/dp2-z1-mb1.json --out /tmp/res/nvlink64k > /tmp/res/nvlink64k.out 2>&1
echo "rc=$? t=$(( $(date +%s) - T0 ))"
for p in static planned dp2-z1-mb1; do echo "== $p"; python3 -c "
import json
for l in open('/tmp/res/nvlink64k/$p/run/metrics.jsonl'):
    d=json.loads(l); print(d['step'], round(d['step_s'],2), round(d['peak_gib'],1), round(d.get('peak_reserved_gib',0),1), d.get('alloc_retries'))"; done
find /tmp/res -name '*.pt' -delete
tar czf $OUT/call$N.tgz -C /tmp/res .
tail -n 12 /tmp/res/nvlink64k.out
