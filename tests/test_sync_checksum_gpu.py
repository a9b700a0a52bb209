"""The weight-sync checksum on one GPU: the Triton block sums give the CPU path's (and so the pure-Python
reference's) checksum bit for bit, ragged last blocks, salts and all, and catch a flipped bit."""

import pytest
import torch

from shardrl.sync.plan import CHECKSUM_BLOCK_BYTES
from shardrl.sync.verify import checksum

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("num_bytes", [8, 13 * 8, CHECKSUM_BLOCK_BYTES, CHECKSUM_BLOCK_BYTES * 3 + 40,
                                       (64 << 20) + 24])
def test_cuda_checksum_equals_the_cpu_one(num_bytes):
    data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for identity, version in ((0, 0), (2**62 + 12345, 9)):
        expected = checksum(data, identity, version)
        assert torch.equal(checksum(data.cuda(), identity, version).cpu(), expected), (num_bytes, identity)
    flipped = data.cuda()
    flipped[num_bytes // 2] ^= 0x20
    assert not torch.equal(checksum(flipped).cpu(), checksum(data))
