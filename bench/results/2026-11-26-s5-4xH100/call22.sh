source .gpu/setup.sh
mkdir -p /tmp/res
python3 -c "import tokenizers, transformers; print(tokenizers.__version__, transformers.__version__)"
A="--model bench/models/qwen2.5-3b.json --gpus 2 --seq-len 32768 --global-batch-tokens 262144 --tp-modes megatron ring --steps 4 --plans static,planned --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g"
NCCL_P2P_DISABLE=1 timeout 560 python3 bench/hotswitch.py $A --label slow --plan-args "--nvlink-gbs 21 --stack fused" --launcher-args "--include localhost:2,3 --master_port 29522" --out /tmp/res/hs-slow > /tmp/res/hs-slow.out 2>&1 &
timeout 560 python3 bench/hotswitch.py $A --label nvlink --plan-args "--stack fused" --launcher-args "--include localhost:0,1 --master_port 29521" --out /tmp/res/hs-nvlink > /tmp/res/hs-nvlink.out 2>&1 &
wait
nvidia-smi --query-gpu=memory.used --format=csv
tar czf $OUT/call22.tgz -C /tmp/res . 
tail -20 /tmp/res/hs-slow.out /tmp/res/hs-nvlink.out
