"""A linear's weight gradient added into its fp32 main_grad: fused into the GEMM (`data.accumulate_weight_grad`,
what CUDA runs: `addmm` with fp32 output and beta 1, in place) against the GEMM in bf16 followed by `main_grad.add_`
(the post-accumulate-grad hook's path), on the same tensors, same process (GPU only).

Shapes are one micro batch of `bench/train_mfu.py` (8192 tokens) through a 1.2B dense model's projections and its
128k LM head. Prints milliseconds per accumulation (CUDA events, `cuda_timing.cuda_ms`), the ratio, and each path's
relative error after two accumulations against fp64.

    python bench/weight_grad_fusion.py
"""

from __future__ import annotations

import torch

from cuda_timing import cuda_ms

# (name, tokens, output features, input features) of the weight [out, in]
SHAPES = [("up/gate projection", 8192, 8192, 2048), ("down projection", 8192, 2048, 8192),
          ("q/k/v projection", 8192, 2560, 2048), ("LM head, 128k vocab", 8192, 128256, 2048)]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("weight_grad_fusion: needs a CUDA GPU")
    for name, tokens, out_features, in_features in SHAPES:
        x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)
        main_grad = torch.zeros(out_features, in_features, device="cuda", dtype=torch.float32)

        def separate() -> None:
            main_grad.add_(grad.t() @ x)

        def fused() -> None:
            torch.addmm(main_grad, grad.t(), x, out_dtype=torch.float32, out=main_grad)

        reference = 2 * (grad.t().double() @ x.double())
        errors = []
        for fn in (separate, fused):
            main_grad.zero_()
            fn()
            fn()
            errors.append(((main_grad - reference).abs().max() / reference.abs().max()).item())
        separate_ms, fused_ms = cuda_ms(separate), cuda_ms(fused)
        print(f"{name} [{out_features} x {in_features}] over {tokens} tokens: GEMM + add {separate_ms:.3f} ms, fused "
              f"{fused_ms:.3f} ms -> {separate_ms / fused_ms:.2f}x; relative error {errors[0]:.1e} -> {errors[1]:.1e}")


if __name__ == "__main__":
    main()
