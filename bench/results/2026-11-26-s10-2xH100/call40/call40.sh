source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call40.sh $OUT/
mkdir -p /tmp/res
python3 -c "import torch; p=torch.cuda.get_device_properties(0); print('total_memory', p.total_memory, p.total_memory/2**30, 'free,total', torch.cuda.mem_get_info())"
B="--gpus 2 --seq-len 32768 --global-batch-tokens 262144 --tp-modes megatron ring --data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json --gpu h100-80g --model bench/models/llama-4b-untied.json --steps 7 --label nvlink"
timeout 570 python3 bench/hotswitch.py $B --plans static --config linear-planned=.gpu/cfg40/linear-planned.json --out /tmp/res/nvlink32k > /tmp/res/nvlink32k.out 2>&1
tar czf $OUT/call40.tgz -C /tmp/res .
grep -E "^step" -r /tmp/res --include=*.log | tail -n 20; tail -n 8 /tmp/res/nvlink32k.out
