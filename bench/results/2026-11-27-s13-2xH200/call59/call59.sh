source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call59.sh $OUT/
mkdir -p /tmp/res59
cp bench/results/2026-11-27-s13-2xH200/call57/nvlink32k/planned/ds_stpar.json /tmp/planned.json
T0=$(date +%s)
for N in 32 4; do
DS_STPAR_P2P_IN_FLIGHT=$N timeout 120 deepspeed --num_gpus 2 launch/pretrain.py --config /tmp/planned.json --data .gpu/stdlib.jsonl \
    --tokenizer .gpu/stdlib-bpe32k.json --steps 3 --seed 1234 --out /tmp/res59/inflight$N > /tmp/res59/inflight$N.log 2>&1
echo "inflight $N rc=$? t=$(( $(date +%s) - T0 ))"; grep -E "^step" /tmp/res59/inflight$N.log | cut -c1-160
python3 -c "
import json
for l in open('/tmp/res59/inflight$N/metrics.jsonl'):
    d=json.loads(l); print(d['step'], round(d['step_s'],2), {k: round(v,2) for k,v in d['bucket_s'].items()}, round(d['peak_gib'],1), round(d.get('peak_reserved_gib',0),1), d.get('alloc_retries'))"
tar czf $OUT/call59.tgz -C /tmp/res59 .
done
