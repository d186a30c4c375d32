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

from epdserve.engine.kv_source import check_kv
from epdserve.transfer.wire import WireError


class PooledKV:
    """One request's KV blocks in a prefill worker's pool mapped or opened by this process:
    the ``runs`` (``(first block, count)``, in order) of ``pool [layers, 2, pool_blocks,
    block_size, kv_heads, head_dim]`` (host or device memory), tagged ``tag`` in ``tags``
    (host memory, int64 per block): a :class:`~epdserve.engine.kv_source.KVSource` with
    the ``shape`` and ``dtype`` of the tensor it stands for, which the decode engine's
    import copies with :meth:`copy_into`: one copy from the prefill worker's cache into the
    decode worker's. ``owner_alive()``: whether the process that exported the pool still
    runs (None: not checked; a /dev/shm mapping stays valid after its owner died, a GPU
    allocation may not)."""

    def __init__(self, request_id: str, pool: torch.Tensor, tags: torch.Tensor, runs: list[tuple[int, int]],
                 tag: int, dtype: torch.dtype, owner_alive: Callable[[], bool] | None = None):
        self.request_id = request_id
        self.pool, self.tags, self.runs, self.tag = pool, tags, runs, tag
        self.ids = [block for first, n in runs for block in range(first, first + n)]
        self.shape = pool.shape[:2] + (len(self.ids),) + pool.shape[3:]
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

    def copy_into(self, kv_cache: torch.Tensor, block_table: list[int], first_block: int = 0) -> None:
        """Copy the blocks into ``kv_cache`` (converting the dtype; any device) at the
        leading entries of ``block_table``, one strided copy per stretch that is
        consecutive on both sides; the first ``first_block`` blocks are skipped (the
        receiver's prefix cache holds them already). On a GPU the copies are waited for
        before the tags are checked again: a check while a copy is still in flight would
        prove nothing.

        Raises:
            WireError: the prefill worker released the blocks (its ``--kv-ttl`` passed while
                the request waited here, an abort) or stopped before the copy ended, so the
                copy is void.
        """
        first = first_block
        self.check()
        for src, dst, n in paired_runs(self.ids[first:], block_table[first:len(self.ids)]):
            kv_cache[:, :, dst:dst + n].copy_(self.pool[:, :, src:src + n])
        wait_for_copies(self.pool, kv_cache)
        self.check()


def wait_for_copies(*tensors: torch.Tensor) -> None:
    """Wait until the work queued on the current CUDA stream of each GPU ``tensors`` live on
    has ended (nothing for host tensors, whose copies are synchronous)."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


def paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src start, dst start, length)`` of each stretch where both id lists count up by one:
    [4, 5, 6, 9], [0, 1, 7, 8] → [(4, 0, 2), (6, 7, 1), (9, 8, 1)]."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
