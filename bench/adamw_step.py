"""The optimizer's update: `parallel.optimizer.AdamW`'s fused kernel (`torch._fused_adamw_`, one pass over each
gradient and the fp32 state) against the multi-tensor chain it replaced (torch's `_foreach_*` ops: weight decay,
lerp, mul, addcmul, sqrt, div, add, addcdiv, and the clipping multiply: eight passes and a temporary), on the same
optimizer state, same process (GPU only).

Sizes are bench/train_mfu.py's models: 1.24B parameters (dense) and 2.5B (the MoE, all experts), as 2-D bf16
weights of 64M elements plus a few 1-D ones (no weight decay), in the optimizer's own pieces (40 MB gradient
buckets, consecutive ones joined: one piece per buffer without the distributed optimizer). Each
timed call updates with clipping active (scale 0.5). Prints milliseconds per update, the ratio, the state's bytes
per millisecond, and the largest difference between the two updates' master weights from one identical state.

    python bench/adamw_step.py
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from cuda_timing import cuda_ms
from shardrl.parallel.layout import Layout
from shardrl.parallel.optimizer import AdamW
from shardrl.parallel.spec import ShardSpec, set_spec

SIZES = {"dense (1.24B)": 1.24e9, "moe (2.5B)": 2.5e9}
MATRIX = (8192, 8192)


def foreach_update(opt: AdamW, grads: list[Tensor], masters: list[Tensor], exp_avgs: list[Tensor],
                   exp_avg_sqs: list[Tensor], decays: list[bool], clip_scale: float) -> None:
    """The multi-tensor AdamW the fused kernel replaced (same maths, op by op)."""
    beta1, beta2 = opt.betas
    torch._foreach_mul_(grads, clip_scale)
    decayed = [master for master, decay in zip(masters, decays) if decay]
    torch._foreach_mul_(decayed, 1 - opt.lr * opt.weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(1 - beta2 ** opt.num_steps))
    torch._foreach_add_(denom, opt.eps)
    torch._foreach_addcdiv_(masters, exp_avgs, denom, value=-opt.lr / (1 - beta1 ** opt.num_steps))


def optimizer(num_params: float) -> AdamW:
    count = int(num_params // (MATRIX[0] * MATRIX[1]))
    params = [set_spec(nn.Parameter(torch.randn(MATRIX, device="cuda", dtype=torch.bfloat16) * 0.02),
                       ShardSpec(f"w{i}", MATRIX)) for i in range(count)]
    params += [set_spec(nn.Parameter(torch.ones(8192, device="cuda", dtype=torch.bfloat16)),
                        ShardSpec(f"n{i}", (8192,))) for i in range(count)]
    opt = AdamW(params, Layout.single("cuda"), lr=1e-4, weight_decay=0.01)
    for buf in opt.grads.buffers:
        buf.data.normal_()
    opt.num_steps = 10
    return opt


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("adamw_step: needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for name, num_params in SIZES.items():
        opt = optimizer(num_params)
        pieces = opt._owned_pieces()
        numel = sum(t.numel() for t in pieces[1])
        saved = [t.clone() for t in (*pieces[0], *pieces[1], *pieces[2], *pieces[3])]

        def restore() -> None:
            for dst, src in zip((*pieces[0], *pieces[1], *pieces[2], *pieces[3]), saved):
                dst.copy_(src)

        foreach_update(opt, *pieces, clip_scale=0.5)
        reference = [t.clone() for t in pieces[1]]
        restore()
        opt._update(*pieces, clip_scale=0.5)
        diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(pieces[1], reference))
        del reference
        restore()
        fused_ms = cuda_ms(lambda: opt._update(*pieces, clip_scale=0.5))
        foreach_ms = cuda_ms(lambda: foreach_update(opt, *pieces, clip_scale=0.5))
        state_bytes = numel * 4 * 7  # reads grad, master, m, v; writes master, m, v (fp32)
        print(f"{name}: {numel / 1e9:.2f}B fp32 elements in {len(pieces[1])} bucket chunks: multi-tensor "
              f"{foreach_ms:7.2f} ms, fused {fused_ms:7.2f} ms ({foreach_ms / fused_ms:.2f}x; fused moves "
              f"{state_bytes / fused_ms / 1e9:.2f} TB/s of state); max |diff| of the masters / max |master| "
              f"{diff:.1e}")
        del opt, pieces, saved
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
