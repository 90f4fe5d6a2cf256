"""Phase 2 (paper III-B): atomic components into blocks. See `rannc.coarsen.blocks`."""

from rannc.coarsen.blocks import (
    CoarsenProblem,
    block_comm_bytes,
    form_blocks,
    form_blocks_reference,
    is_convex,
)

__all__ = ["CoarsenProblem", "block_comm_bytes", "form_blocks", "form_blocks_reference", "is_convex"]
