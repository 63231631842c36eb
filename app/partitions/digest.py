"""Block digests: the names under which a prompt's whole blocks of keys and values are cached.

A digest names a block and every block before it (vLLM's block hashes): block k's digest is the
hash of block k-1's digest and block k's token ids, so equal digests mean equal prefixes (up to a
collision of a 128-bit BLAKE2b). The prefix cache of today's stages (`app.partitions.prefix`) and
the paged engine's block pool (`app.workers.engine.blocks`) name blocks the same way. No torch here:
the step scheduler imports it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BLOCK = 16  # tokens per block: the unit a prefix is found and stored in


def digests(ids: Sequence[int], blocks: int, size: int = BLOCK) -> list[bytes]:
    """The chain digest of each of the first `blocks` whole blocks of `size` tokens of `ids`."""
    chain, out = b"", []
    for k in range(blocks):
        block = array("q", ids[k * size : (k + 1) * size]).tobytes()
        chain = hashlib.blake2b(chain + block, digest_size=16).digest()
        out.append(chain)
    return out
