source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call64.sh $OUT/; cp -r .gpu/s15 $OUT/
mkdir -p /tmp/res
T0=$(date +%s)
SEED=${SEED:-1234}
B="--gpus 2 --seq-len 65536 --global-batch-tokens 524288 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --model bench/models/llama-3b.json --gpu h100-80g --steps 6 --seed $SEED --label nvlink"
timeout 555 python3 bench/hotswitch.py $B --plans "" --config planned=.gpu/s15/planned.json --config dp2-z1-mb1=.gpu/s15/dp2-z1-mb1.json --baseline dp2-z1-mb1 --out /tmp/res/nvlink64k > /tmp/res/nvlink64k.out 2>&1
echo "rc=$? t=$(( $(date +%s) - T0 ))"
for p in planned dp2-z1-mb1; do echo "== $p"; python3 -c "
import json
for l in open('/tmp/res/nvlink64k/$p/run/metrics.jsonl'):
    d=json.loads(l); print(d['step'], round(d['step_s'],2), round(d['peak_gib'],1), round(d.get('peak_reserved_gib',0),1), d.get('alloc_retries'))"; done
find /tmp/res -name '*.pt' -delete
tar czf $OUT/call64.tgz -C /tmp/res .
tail -n 12 /tmp/res/nvlink64k.out
