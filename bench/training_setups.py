"""Saved activation bytes and the step's peak of a tiny HF Llama in the setups people train
with: fp32, autocast (fp32 master weights), HF gradient checkpointing, torch.compile, PEFT LoRA
(with and without lora_dropout), packed sequences; unpatched vs patched presets. The peak is
ckpt_ext.peak_memory_bytes of a training step after a first one (its gradients present).
CPU, a minute: python bench/training_setups.py (prints the table in docs/hf.md; bench/results/training_setups_cpu.txt)."""
import copy, os, sys, torch, warnings
warnings.simplefilter("ignore")
import ckpt_ext
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import hf_checkpointing  # noqa: E402
cfg = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=256, use_cache=False)
torch.manual_seed(0)
base = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
ids = torch.randint(0, 256, (2, 64)); mask = torch.ones(2, 64, dtype=torch.long); mask[0, :8] = 0
def measured(loss):
    """(saved bytes of the forward, peak of a training step after a first one)"""
    loss().backward()
    return (ckpt_ext.saved_activation_bytes(loss),
            ckpt_ext.peak_memory_bytes(lambda: loss().backward()))


def nbytes(m, amp=False):
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            return m(input_ids=ids, attention_mask=mask, labels=ids).loss
    return measured(step)
rows = []
rows.append(("fp32, unpatched", nbytes(base)))
for p in ("balanced", "min_memory"):
    rows.append((f"fp32, {p}", nbytes(ckpt_ext.patch_llama(copy.deepcopy(base), p))))
rows.append(("autocast bf16 (fp32 master), unpatched", nbytes(base, True)))
for p in ("balanced", "min_memory"):
    rows.append((f"autocast bf16 (fp32 master), {p}", nbytes(ckpt_ext.patch_llama(copy.deepcopy(base), p), True)))
gc = hf_checkpointing(copy.deepcopy(base))
rows.append(("HF gradient checkpointing, unpatched", nbytes(gc)))
rows.append(("HF gradient checkpointing, patched (default policy)", nbytes(ckpt_ext.patch_llama(copy.deepcopy(gc)))))
for p in ("balanced", "min_memory"):
    m = ckpt_ext.patch_llama(copy.deepcopy(base), p)
    rows.append((f"torch.compile (aot_eager), {p}", nbytes(torch.compile(m, backend="aot_eager"))))
import peft  # noqa: E402
lora_cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
lora = peft.get_peft_model(copy.deepcopy(base), lora_cfg)
rows.append(("LoRA r8 (all projections), unpatched", nbytes(lora)))
rows.append(("LoRA r8 (all projections), balanced",
             nbytes(ckpt_ext.patch_llama(copy.deepcopy(lora), "balanced"))))
drop_cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                           target_modules=lora_cfg.target_modules)
drop = peft.get_peft_model(copy.deepcopy(base), drop_cfg)
rows.append(("LoRA r8 + lora_dropout 0.05, unpatched", nbytes(drop)))
rows.append(("LoRA r8 + lora_dropout 0.05, balanced",
             nbytes(ckpt_ext.patch_llama(copy.deepcopy(drop), "balanced"))))
pos = torch.cat([torch.arange(n) for n in (20, 7, 30, 7)])[None].repeat(2, 1)


def packed_bytes(m):
    return measured(lambda: m(input_ids=ids, position_ids=pos, labels=ids).loss)


rows.append(("packed (4 documents per row), unpatched", packed_bytes(base)))
rows.append(("packed (4 documents per row), balanced",
             packed_bytes(ckpt_ext.patch_llama(copy.deepcopy(base), "balanced"))))
print("| setup | saved bytes | step peak bytes |\n|---|---|---|")
for name, (saved, peak) in rows:
    print(f"| {name} | {saved:,} | {peak:,} |")
