source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/res
A="--model bench/models/llama-4b.json --gpus 2 --seq-len 32768 --global-batch-tokens 262144 --tp-modes megatron ring --steps 6 --plans static,planned --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g"
NCCL_P2P_DISABLE=1 timeout 570 python3 bench/hotswitch.py $A --label slow --plan-args "--nvlink-gbs 21 --stack fused" --launcher-args "--include localhost:2,3 --master_port 29522" --out /tmp/res/hs-slow > /tmp/res/hs-slow.out 2>&1 &
timeout 570 python3 bench/hotswitch.py $A --label nvlink --plan-args "--stack fused" --launcher-args "--include localhost:0,1 --master_port 29521" --out /tmp/res/hs-nvlink > /tmp/res/hs-nvlink.out 2>&1 &
wait
tar czf $OUT/call24.tgz -C /tmp/res .
tail -n 5 /tmp/res/hs-slow.out; tail -n 5 /tmp/res/hs-nvlink.out
