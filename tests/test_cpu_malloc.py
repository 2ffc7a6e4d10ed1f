"""A CPU engine keeps freed memory for reuse (`cpu_malloc.py`): repeated prefills stop page-faulting."""

import subprocess
import sys

# A fresh process each (the allocator setting is process-wide): three prefills of two 700-token prompts on a
# Llama with hidden 256 / intermediate 1024, whose activations (0.7-5.7 MB) are above glibc's default mmap
# threshold; prints the minor page faults of the last one.
SCRIPT = """
import resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
import domino_ray.engine
from domino_ray.engine import SpecEngine
from domino_ray.request import Request
from domino_ray.sampling_params import SamplingParams
if sys.argv[1] == "glibc-defaults":
    domino_ray.engine.keep_freed_memory = lambda: False
torch.set_num_threads(1)
target = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)).eval()
engine = SpecEngine(target, max_rows=2, max_model_len=1024)
params = SamplingParams(max_new_tokens=1, ignore_eos=True)
for i in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.generate([Request(j, [(j + 7 * t) % 90 for t in range(700)], params) for j in range(2)])
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def prefill_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         check=True, timeout=300)
    return int(out.stdout.split()[-1])


def test_a_cpu_engine_reuses_freed_memory_across_prefills():
    default, kept = prefill_faults("glibc-defaults"), prefill_faults("engine")
    assert default > 1000, default  # the workload does fault with glibc's defaults: the comparison means something
    assert kept < default / 10, (kept, default)


def test_keep_freed_memory_is_idempotent():
    from domino_ray.cpu_malloc import keep_freed_memory

    assert keep_freed_memory() is keep_freed_memory()
