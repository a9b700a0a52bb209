"""A linear's weight gradient added into its fp32 main_grad: fused into the GEMM (`data.accumulate_weight_grad`,
what CUDA runs: `addmm` with fp32 output and beta 1, in place) against the GEMM in bf16 followed by `main_grad.add_`
(the post-accumulate-grad hook's path), on the same tensors, same process (GPU only).

Shapes are one micro batch of `bench/train_mfu.py` (8192 tokens) through a 1.2B dense model's projections and its
128k LM head. Prints milliseconds per accumulation (CUDA events, `cuda_timing.cuda_ms`), the ratio, and each path's
relative error after two accumulations against fp64.

Then the experts, whose grouped GEMMs have no fp32 output: the bf16 weight gradient of one expert weight of the
MoE bench model (16 experts, 1408 x 2048; 32,768 rows over the experts) added by torch's mixed-dtype `add_` against
the Triton pass (`grad_add_kernel`, what `data.add_into_main_grad` runs), alone and after the grouped GEMM.

Last the embedding of the dense bench model (128k x 2048, 8192 tokens): torch's backward (a dense bf16 [V, H]
gradient) plus the addition into main_grad, against the rows' gradients put into main_grad's rows
(`data.accumulate_embedding_grad`).

    PYTHONPATH=. python bench/weight_grad_fusion.py
"""

from __future__ import annotations

from collections.abc import Callable

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



def experts() -> None:
    from shardrl.parallel.grad_add_kernel import add_into_fp32

    num_experts, ffn, hidden, rows = 16, 1408, 2048, 32768
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(1, num_experts + 1, device="cuda", dtype=torch.int32) * (rows // num_experts)
    weight_grad = torch.nn.functional.grouped_mm(grad.t(), x, offs=offsets)  # [E, F, H] bf16
    main_grad = torch.zeros(weight_grad.shape, device="cuda", dtype=torch.float32)
    bytes_moved = main_grad.numel() * (2 * 4 + 2)

    def gemm_then(add) -> Callable[[], None]:
        return lambda: add(main_grad, torch.nn.functional.grouped_mm(grad.t(), x, offs=offsets))

    torch_add, triton_add = (lambda m, g: m.add_(g)), add_into_fp32
    times = {name: cuda_ms(lambda: add(main_grad, weight_grad)) for name, add in (("torch", torch_add),
                                                                                  ("triton", triton_add))}
    print(f"expert weight gradient [{num_experts} x {ffn} x {hidden}] into fp32 main_grad: torch add_ "
          f"{times['torch']:.3f} ms ({bytes_moved / times['torch'] / 1e6:.0f} GB/s), Triton pass "
          f"{times['triton']:.3f} ms ({bytes_moved / times['triton'] / 1e6:.0f} GB/s) -> "
          f"{times['torch'] / times['triton']:.2f}x")
    with_gemm = {name: cuda_ms(gemm_then(add)) for name, add in (("torch", torch_add), ("triton", triton_add))}
    print(f"  with its grouped GEMM over {rows} rows: {with_gemm['torch']:.3f} -> {with_gemm['triton']:.3f} ms, "
          f"{with_gemm['torch'] / with_gemm['triton']:.2f}x")


def embedding() -> None:
    from shardrl.parallel.data import GradBuffers, accumulate_embedding_grad, add_into_main_grad
    from shardrl.parallel.layout import Layout
    from shardrl.parallel.spec import ShardSpec, set_spec

    vocab, hidden, tokens = 128256, 2048, 8192
    layout = Layout.single("cuda")
    weight = set_spec(torch.nn.Parameter(torch.empty(vocab, hidden, device="cuda", dtype=torch.bfloat16)),
                      ShardSpec("embed_tokens.weight", (vocab, hidden)))
    buffers = GradBuffers([weight], layout)
    ids = torch.randint(0, vocab, (tokens,), device="cuda")
    grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)

    def dense_then_add() -> None:  # torch's embedding backward, then what the hook did with its result
        add_into_main_grad(weight, torch.ops.aten.embedding_dense_backward(grad, ids, vocab, -1, False))

    def rows() -> None:
        accumulate_embedding_grad(weight, ids, grad)

    reference = torch.zeros(vocab, hidden, device="cuda", dtype=torch.float64).index_add_(0, ids, grad.double())
    errors = []
    for fn in (dense_then_add, rows):
        buffers.zero()
        fn()
        errors.append(((weight.main_grad - reference).abs().max() / reference.abs().max()).item())
    dense_ms, rows_ms = cuda_ms(dense_then_add), cuda_ms(rows)
    print(f"embedding [{vocab} x {hidden}] over {tokens} tokens into fp32 main_grad: dense gradient + add "
          f"{dense_ms:.3f} ms, rows into main_grad {rows_ms:.3f} ms -> {dense_ms / rows_ms:.2f}x; relative error "
          f"{errors[0]:.1e} -> {errors[1]:.1e}")


if __name__ == "__main__":
    main()
    experts()
    embedding()
