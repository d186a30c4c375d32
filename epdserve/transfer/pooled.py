"""One request's KV blocks read straight out of a prefill worker's whole KV cache that this
process can address: a /dev/shm pool it mapped (:func:`epdserve.transfer.shm.map_pool`) or
a GPU allocation it opened by CUDA IPC (:class:`epdserve.transfer.cuda_ipc.IpcImporter`).
Either way the blocks carry the hand-off's tag in the prefill worker's tag array, which is
checked before the copy and again after it (once the copy has really ended, on a GPU), so a
late or forged descriptor yields a clear error, never another request's KV.
"""

from __future__ import annotations

from typing import Callable

import torch

from epdserve.engine.kv_parts import KVParts, copy_blocks
from epdserve.engine.kv_source import check_kv
from epdserve.transfer.wire import WireError


class PooledKV:
    """One request's KV blocks in a prefill worker's pool mapped or opened by this process:
    the ``runs`` (``(first block, count)``, in order) of ``pool`` (its parts ``[layers, 2,
    pool_blocks, block_size, heads of the part, head_dim]``, one per rank of the prefill
    worker; host or device memory), tagged ``tag`` in ``tags`` (host memory, int64 per
    block): a :class:`~epdserve.engine.kv_source.KVSource` with the ``shape`` (every KV
    head) and ``dtype`` of the tensor it stands for, which the decode engine's import
    copies with :meth:`copy_into`: one copy from the prefill worker's cache into the
    decode worker's, each of its ranks' heads from the prefill ranks holding them.
    ``owner_alive()``: whether the process that exported the pool still runs (None: not
    checked; a /dev/shm mapping stays valid after its owner died, a GPU allocation may
    not)."""

    def __init__(self, request_id: str, pool: KVParts, tags: torch.Tensor, runs: list[tuple[int, int]],
                 tag: int, dtype: torch.dtype, owner_alive: Callable[[], bool] | None = None):
        self.request_id = request_id
        self.pool, self.tags, self.runs, self.tag = pool, tags, runs, tag
        self.ids = [block for first, n in runs for block in range(first, first + n)]
        self.shape = pool.block_shape(len(self.ids))
        self.dtype = dtype
        self.owner_alive = owner_alive

    def check(self) -> None:
        """Raises :class:`WireError` unless every block still carries this hand-off's tag
        and the pool's owner (where checked) still runs."""
        if self.owner_alive is not None and not self.owner_alive():
            raise WireError(f"the prefill worker that exported the KV of {self.request_id} is gone")
        if not bool((self.tags[self.ids] == self.tag).all()):
            raise WireError(f"KV blocks of {self.request_id} are no longer held by the prefill worker "
                            f"(released, expired, or not this request's)")

    def validate(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        check_kv(self.shape, self.dtype, shape, dtype)

    def copy_into(self, kv_cache: KVParts, block_table: list[int], first_block: int = 0) -> None:
        """Copy the blocks into ``kv_cache`` (converting the dtype; any device) at the
        leading entries of ``block_table`` (:func:`~epdserve.engine.kv_parts.copy_blocks`);
        the first ``first_block`` blocks are skipped (the receiver's prefix cache holds
        them already). On a GPU the copies are waited for before the tags are checked
        again: a check while a copy is still in flight would prove nothing.

        Raises:
            WireError: the prefill worker released the blocks (its ``--kv-ttl`` passed while
                the request waited here, an abort) or stopped before the copy ended, so the
                copy is void.
        """
        first = first_block
        self.check()
        copy_blocks(self.pool, self.ids[first:], kv_cache, block_table[first:len(self.ids)])
        wait_for_copies(*self.pool.parts, *kv_cache.parts)
        self.check()


def wait_for_copies(*tensors: torch.Tensor) -> None:
    """Wait until the work queued on the current CUDA stream of each GPU ``tensors`` live on
    has ended (nothing for host tensors, whose copies are synchronous)."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
