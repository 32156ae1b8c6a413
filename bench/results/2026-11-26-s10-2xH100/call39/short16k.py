# writes .gpu/short16k.jsonl: the corpus's documents of at most 16384 BPE tokens
import json

from ds_stpar.seqbucket.tokenize import load_tokenizer

tok = load_tokenizer(".gpu/stdlib-bpe32k.json")
docs = [json.loads(line) for line in open(".gpu/stdlib.jsonl")]
lens = [len(x) for x in tok.encode_batch([d["text"] for d in docs])]
with open(".gpu/short16k.jsonl", "w") as f:
    for d, n in zip(docs, lens):
        if n <= 16384:
            f.write(json.dumps(d) + "\n")
print(sum(n <= 16384 for n in lens), sum(n for n in lens if n <= 16384))
