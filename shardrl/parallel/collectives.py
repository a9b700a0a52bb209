"""The flat-tensor all-gather and reduce-scatter under the installed torch's own names. torch 2.13 renamed
`all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` / `reduce_scatter_single` (same
arguments) and warns on every call of the old names; an older torch (the GPU machine's is 2.11) has only those."""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
