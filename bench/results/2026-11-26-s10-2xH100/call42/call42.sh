source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call42.sh $OUT/
mkdir -p /tmp/res
B="--gpus 2 --seq-len 131072 --global-batch-tokens 524288 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g --model bench/models/llama-4b-untied-128k.json --label slow --plan-args=--nvlink-gbs=21"
export NCCL_P2P_DISABLE=1
T0=$(date +%s)
timeout 230 python3 bench/hotswitch.py $B --steps 3 --plans planned --out /tmp/res/slow128k-planned > /tmp/res/slow128k-planned.out 2>&1
echo "planned done t=$(( $(date +%s) - T0 ))"
timeout $(( 395 - $(date +%s) + T0 )) python3 bench/hotswitch.py $B --steps 2 --plans static --out /tmp/res/slow128k-static > /tmp/res/slow128k-static.out 2>&1
echo "static done t=$(( $(date +%s) - T0 ))"
tar czf $OUT/call42.tgz -C /tmp/res .
grep -E "^step" -r /tmp/res --include=*.log | tail -n 20; tail -n 4 /tmp/res/slow128k-planned.out /tmp/res/slow128k-static.out
