import os

import torch

# Tests never reach a model hub; a stray download attempt fails fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads, and OpenMP workers spinning against other busy
# processes on a small machine slow every op by orders of magnitude.
torch.set_num_threads(1)
