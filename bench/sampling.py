"""The decode step's sampling alone: the fused CUDA sampler (`sample_kernel.py`) against the portable torch ops,
each captured in a CUDA graph as decode runs it, on bf16 logits over Qwen2's 151,936-token vocabulary.

    python3 bench/sampling.py   # rows 64 / 256 / 512, temperature 1 unseeded (the throughput bench) and 0.7 seeded
"""

from __future__ import annotations

import torch

from shardrl.rollout.request import SamplingParams
from shardrl.rollout.sampler import SamplingBatch, sample

VOCAB = 151_936


def graph_us(fn, repeats: int = 50) -> float:
    """Mean device time of one replay of `fn` captured in a CUDA graph, in microseconds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and load the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / repeats


def main() -> None:
    device = torch.device("cuda")
    print(f"{'rows':>5} {'sampling':<22} {'portable us':>12} {'fused us':>9} {'speed-up':>9}")
    for rows in (64, 256, 512):
        logits = (torch.randn(rows, VOCAB, device=device) * 3).bfloat16()
        counters = torch.arange(rows, device=device) + 300
        for name, params, seeds in (("T=1 unseeded", SamplingParams(), [None] * rows),
                                    ("T=0.7 seeded, raw", SamplingParams(temperature=0.7, raw_logprobs=True),
                                     list(range(rows)))):
            batch = SamplingBatch.build([params] * rows, seeds, VOCAB, device)
            times = [graph_us(lambda: sample(logits, batch, counters, torch.cuda.default_generators[0], fused=f))
                     for f in (False, True)]
            print(f"{rows:>5} {name:<22} {times[0]:>12.1f} {times[1]:>9.1f} {times[0] / times[1]:>8.2f}x")


if __name__ == "__main__":
    main()
