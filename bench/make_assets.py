"""(From shared/reference/anchor/make_assets.py, with more sizes.) Build a DeepSeek-Coder-1.3B-shaped model (random weights), a 32k BPE tokenizer and a
pseudo2norm-shaped dataset (IDA-like pseudo-C -> placeholder skeleton), all offline."""
import json, os, random, sys
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast, LlamaConfig, LlamaForCausalLM
import torch
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
size = sys.argv[2] if len(sys.argv) > 2 else "1.3b"
rng = random.Random(0)
def stmt(d=0):
    k = rng.random()
    v = lambda: f"v{rng.randint(1,30)}"
    if k < 0.35: return f"{v()} = sub_{rng.randint(4096,65535):X}({v()}, {rng.randint(0,4096)}LL, *(int *)({v()} + {rng.randint(0,64)}));"
    if k < 0.6: return f"*(_QWORD *)(a1 + {8*rng.randint(0,32)}) = {v()} + {rng.randint(1,99)};"
    if k < 0.8 and d < 2: return "if ( %s > %d ) {\n%s\n}" % (v(), rng.randint(0,99), "\n".join(stmt(d+1) for _ in range(rng.randint(1,4))))
    if d < 2: return "for ( %s = 0; %s < %d; ++%s ) {\n%s\n}" % (v(), v(), rng.randint(1,64), v(), "\n".join(stmt(d+1) for _ in range(rng.randint(1,4))))
    return f"return {v()};"
def func(n):
    body = "\n".join(stmt() for _ in range(n))
    return f"long long sub_{rng.randint(4096,65535):X}(long long a1, int a2) {{\n{body}\n}}"
def skeleton(src):
    import re
    s = re.sub(r"sub_[0-9A-F]+", "func1", src); s = re.sub(r"\bv(\d+)", r"var\1", s)
    return s.replace("_QWORD", "type1").replace("a1", "var0")
rows = []
for i in range(800):
    f = func(rng.randint(3, 30))
    rows.append({"instruction": "", "input": f"# This is the pseudo code:\n{f}\n# What is the source code?\n", "output": skeleton(f)})
with open(f"{out}/pseudo2norm.jsonl", "w") as fh:
    for r in rows: fh.write(json.dumps(r) + "\n")
json.dump({"pseudo2norm": {"file_name": "pseudo2norm.jsonl", "columns": {"prompt": "instruction", "query": "input", "response": "output"}}}, open(f"{out}/dataset_info.json", "w"))
tok = Tokenizer(models.BPE()); tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False); tok.decoder = decoders.ByteLevel()
special = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>"]  # DeepSeek-Coder names: sk2decompile appends the EOS as text
corpus = [r["input"] + r["output"] for r in rows]
# mix in random identifiers so the BPE does not collapse whole lines into single tokens
corpus += [" ".join(f"tok{rng.randint(0,99999)}" for _ in range(200)) for _ in range(200)]
tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=16000, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
ft = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special[0], eos_token=special[1], pad_token=special[2])
ft.save_pretrained(f"{out}/model")
lens = [len(ft(r["input"] + r["output"])["input_ids"]) for r in rows]
lens.sort(); print("tokens/sample p50", lens[len(lens)//2], "p90", lens[int(len(lens)*.9)], "max", lens[-1], "mean", sum(lens)/len(lens))
if size == "none": sys.exit(0)  # the tokenizer and data only (model_zoo.py builds its own models)
shape = {"350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16),
         "1.3b": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16),
         "6.7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
         # the 6.7B's width with 12 of its 32 layers: its offloaded states (~70 GiB) fit the H200 host's 128 GiB
         "6.7b-12l": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=32)}[size]
cfg = LlamaConfig(vocab_size=32256, **shape, max_position_embeddings=16384, rope_theta=100000.0, bos_token_id=0, eos_token_id=1,
                  tie_word_embeddings=False, torch_dtype="bfloat16")
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
print("params", sum(p.numel() for p in m.parameters()) / 1e9, "B")
mdir = f"{out}/model" if size == "1.3b" else f"{out}/model_{size}"
if mdir != f"{out}/model":
    ft.save_pretrained(mdir)
m.save_pretrained(mdir)
