source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call53.sh $OUT/
mkdir -p /tmp/res
B="--gpus 2 --seq-len 32768 --global-batch-tokens 262144 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g --model bench/models/llama-4b-untied.json --steps 7 --label nvlink"
T0=$(date +%s)
DS_STPAR_FUSED_ROPE=0 timeout 200 python3 bench/hotswitch.py $B --plans static --out /tmp/res/unfused-rope > /tmp/res/unfused-rope.out 2>&1
echo "unfused t=$(( $(date +%s) - T0 ))"
timeout 360 python3 bench/hotswitch.py $B --plans static,planned --out /tmp/res/nvlink32k > /tmp/res/nvlink32k.out 2>&1
echo "fused t=$(( $(date +%s) - T0 ))"
tar czf $OUT/call53.tgz -C /tmp/res .
grep -E "^step" -r /tmp/res --include=*.log | cut -c1-150; tail -n 3 /tmp/res/unfused-rope.out; tail -n 4 /tmp/res/nvlink32k.out
