source .gpu/setup.sh > /dev/null 2>&1
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $CARD"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call61.sh $OUT/
mkdir -p /tmp/res
case "$CARD" in *H200*) MODEL=llama-4b-untied-64k;; *) MODEL=llama-3b;; esac
echo "model: $MODEL" | tee /tmp/res/model.txt
T0=$(date +%s)
summary() {
  python3 -c "
import json
for l in open('/tmp/res/$1/metrics.jsonl'):
    d=json.loads(l); print(d['step'], round(d['step_s'],2), round(d['peak_gib'],1), round(d.get('peak_reserved_gib',0),1), d.get('alloc_retries'))"
}
B="--gpus 2 --seq-len 65536 --global-batch-tokens 524288 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --model bench/models/$MODEL.json --steps 6 --label nvlink"
timeout 545 python3 bench/hotswitch.py $B --plans static,planned --out /tmp/res/nvlink64k > /tmp/res/nvlink64k.out 2>&1
echo "nvlink rc=$? t=$(( $(date +%s) - T0 ))"
summary nvlink64k/static/run; summary nvlink64k/planned/run
find /tmp/res -name '*.pt' -delete
tar czf $OUT/call61.tgz -C /tmp/res .
tail -n 30 /tmp/res/nvlink64k.out
