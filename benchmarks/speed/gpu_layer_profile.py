"""Where a PKM layer step's time goes on a GPU: torch.profiler tables (CUDA kernel time, CPU time) of one forward + backward
at the paper's size, 8 x 128 tokens, for lucidrains' PKM and ours (dense, sparse value gradient). Run on a CUDA machine:
`python -m benchmarks.speed.gpu_layer_profile` from the repository root; benchmarks/RESULTS.md (section 5, H200) reads its totals."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.speed import common  # the layer builders of the speed section `layer`

if not torch.cuda.is_available():
    sys.exit("gpu_layer_profile.py profiles CUDA kernels: no CUDA device here")
x = torch.randn(8, 128, 768, device="cuda", requires_grad=True)
g = torch.randn(8, 128, 768, device="cuda")
for impl in ("lucidrains", "ours_dense", "ours_sparse"):
    module = common.build_layer(impl).cuda().train()
    step = common.layer_step_fn(module, x, g)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(f"\n===== {impl}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=70))
