source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call63.sh $OUT/; cp -r .gpu/alt $OUT/
mkdir -p /tmp/res
T0=$(date +%s)
B="--gpus 2 --seq-len 65536 --global-batch-tokens 524288 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --model bench/models/llama-3b.json --gpu h100-80g --steps 3 --seed 1234 --label nvlink"
timeout 540 python3 bench/hotswitch.py $B --plans static --config ring-mb2=.gpu/alt/ring-mb2.json --config dp2-z1-mb1=.gpu/alt/dp2-z1-mb1.json --out /tmp/res/static64k > /tmp/res/static64k.out 2>&1
echo "rc=$? t=$(( $(date +%s) - T0 ))"
for p in static ring-mb2 dp2-z1-mb1; do echo "== $p"; python3 -c "
import json
for l in open('/tmp/res/static64k/$p/run/metrics.jsonl'):
    d=json.loads(l); print(d['step'], round(d['step_s'],2), round(d['peak_gib'],1), round(d.get('peak_reserved_gib',0),1), d.get('alloc_retries'))"; done
find /tmp/res -name '*.pt' -delete
tar czf $OUT/call63.tgz -C /tmp/res .
tail -n 12 /tmp/res/static64k.out
