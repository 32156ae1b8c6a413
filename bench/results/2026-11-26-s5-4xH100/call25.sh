source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/res
B="--gpus 2 --seq-len 32768 --global-batch-tokens 262144 --tp-modes megatron ring --steps 4 --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g"
export NCCL_P2P_DISABLE=1
timeout 390 python3 bench/hotswitch.py --model bench/models/llama-4b.json $B --plans static,planned --label slow --plan-args "--nvlink-gbs 21" --launcher-args "--include localhost:2,3 --master_port 29522" --out /tmp/res/l4b-slow > /tmp/res/l4b-slow.out 2>&1 &
timeout 390 python3 bench/hotswitch.py --model bench/models/qwen2.5-3b.json $B --plans static --label slow --plan-args "--nvlink-gbs 21" --launcher-args "--include localhost:0,1 --master_port 29521" --out /tmp/res/qwen-slow > /tmp/res/qwen-slow.out 2>&1 &
wait
tar czf $OUT/call25.tgz -C /tmp/res .
tail -n 5 /tmp/res/l4b-slow.out; tail -n 5 /tmp/res/qwen-slow.out
