source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call57.sh $OUT/
mkdir -p /tmp/res
cp bench/results/2026-11-26-s12-2xH100/call53/nvlink32k/static/ds_stpar.json /tmp/static.json
T0=$(date +%s)
summary() {
  python3 -c "
import json
for l in open('/tmp/res/$1/metrics.jsonl'):
    d=json.loads(l); print(d['step'], round(d['step_s'],2), round(d['peak_gib'],1), round(d.get('peak_reserved_gib',0),1), d.get('alloc_retries'))"
}
DS_STPAR_P2P_IN_FLIGHT=0 timeout 130 deepspeed --num_gpus 2 launch/pretrain.py --config /tmp/static.json --data .gpu/stdlib.jsonl \
    --tokenizer .gpu/stdlib-bpe32k.json --steps 3 --seed 1234 --out /tmp/res/static-unbounded > /tmp/res/static-unbounded.log 2>&1
echo "unbounded rc=$? t=$(( $(date +%s) - T0 ))"; summary static-unbounded
tar czf $OUT/call57.tgz -C /tmp/res .
B="--gpus 2 --seq-len 32768 --global-batch-tokens 262144 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g --model bench/models/llama-4b-untied.json --steps 7 --label nvlink"
timeout 380 python3 bench/hotswitch.py $B --plans static,planned --out /tmp/res/nvlink32k > /tmp/res/nvlink32k.out 2>&1
echo "nvlink rc=$? t=$(( $(date +%s) - T0 ))"
summary nvlink32k/static/run; summary nvlink32k/planned/run
tar czf $OUT/call57.tgz -C /tmp/res .
tail -n 4 /tmp/res/nvlink32k.out
