"""Rank 0 <-> follower messages of a tensor-parallel worker: ZeroMQ multipart, a msgpack header then
one raw frame per tensor (row-major, on the host; bfloat16 as a ``uint8`` view), never pickle.

Rank 0 -> follower: header ``{"op", "tensors": [[dtype name, shape], ...], **fields}``:

* ``init``: ``num_blocks``, ``block_size``, ``shape`` (the worker's whole KV cache), ``dtype``,
  ``split`` (each rank's KV heads), ``pool`` (the /dev/shm pool holding this rank's part, or
  None: allocate it on the GPU and share it by the ``ready``'s handle);
* ``hidden_states`` / ``forward``: ``prefills`` (``[[start, q_len, ctx_len], ...]``), ``embeds``
  (bool); tensors ``input_ids``, :data:`META_FIELDS`, each prefill's ``block_table``, then with
  ``embeds`` the embedding rows and values;
* ``logits``: hidden rows ``[R, hidden]``; ``encode``: tiles ``[N, 3, H, W]``; ``stop``.

Follower -> rank 0: ``{"rank", "state": "loaded" | "ready" | "error", "error", "handle"}``;
``handle``: a CUDA ``ready``'s KV cache (``transfer.cuda_ipc.pack_handle``), else empty."""

from __future__ import annotations

import msgpack
import torch

from epdserve.model.llama import AttentionMetadata, PrefillSeq

# Any other dtype is refused.
DTYPES = {name: getattr(torch, name) for name in ("int64", "int32", "float32", "bfloat16", "float16", "uint8", "bool")}
STEP_OPS = ("hidden_states", "forward")
META_FIELDS = ("positions", "slot_mapping", "decode_rows", "decode_block_tables", "decode_ctx_lens", "logits_rows")

Step = tuple[torch.Tensor, AttentionMetadata, tuple[torch.Tensor, torch.Tensor] | None]


class MessageError(ValueError):
    """A bug, or a frame from something else."""


def _tensor_frame(t: torch.Tensor) -> tuple[list, bytes | memoryview]:
    """``([dtype name, shape], raw bytes)``, copied to the host."""
    t = t.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise MessageError(f"a tensor of {t.dtype} cannot be sent to another rank")
    data = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
    return [name, list(t.shape)], data


def _tensor(spec, frame: bytes) -> torch.Tensor:
    name, shape = spec
    if name not in DTYPES:
        raise MessageError(f"unknown dtype {name!r} in a rank message")
    dtype = DTYPES[name]
    expected = torch.Size(shape).numel() * dtype.itemsize
    if len(frame) != expected:
        raise MessageError(f"a {name} tensor of shape {shape} needs {expected} bytes, the frame has {len(frame)}")
    if not expected:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(dtype).reshape(shape)


def encode(op: str, tensors: list[torch.Tensor] = (), **fields) -> list:
    specs, data = zip(*(_tensor_frame(t) for t in tensors)) if tensors else ((), ())
    return [msgpack.packb({"op": op, "tensors": list(specs), **fields}), *data]


def decode(frames: list[bytes]) -> tuple[dict, list[torch.Tensor]]:
    """``(header, tensors)``. Raises MessageError: not a msgpack map with ``op`` and ``tensors``, or
    frames that do not match it."""
    try:
        header = msgpack.unpackb(frames[0])
    except (ValueError, msgpack.UnpackException, IndexError) as exc:
        raise MessageError(f"not a rank message: {exc}") from None
    if not isinstance(header, dict) or "op" not in header or not isinstance(header.get("tensors"), list):
        raise MessageError("not a rank message: its header has no op or tensors")
    if len(header["tensors"]) != len(frames) - 1:
        raise MessageError(f"{header['op']}: {len(header['tensors'])} tensors announced, {len(frames) - 1} frames")
    return header, [_tensor(spec, frame) for spec, frame in zip(header["tensors"], frames[1:])]


def encode_step(op: str, input_ids: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None) -> list:
    tensors = [input_ids, *(getattr(meta, name) for name in META_FIELDS), *(p.block_table for p in meta.prefills),
               *(embeds or ())]
    return encode(op, tensors, prefills=[[p.start, p.q_len, p.ctx_len] for p in meta.prefills],
                  embeds=embeds is not None)


def decode_step(header: dict, tensors: list[torch.Tensor]) -> Step:
    """``(input_ids, meta, embeds)``, on the host. Raises MessageError: the tensors do not
    match the header's prefills and embeds."""
    prefills, embeds = header.get("prefills"), header.get("embeds")
    if not isinstance(prefills, list) or len(tensors) != 1 + len(META_FIELDS) + len(prefills) + 2 * bool(embeds):
        raise MessageError(f"{header['op']}: {len(tensors)} tensors do not match its prefills and embeds")
    input_ids, *rest = tensors
    fields = dict(zip(META_FIELDS, rest))
    tables = rest[len(META_FIELDS):len(META_FIELDS) + len(prefills)]
    seqs = [PrefillSeq(start=s, q_len=q, ctx_len=c, block_table=t) for (s, q, c), t in zip(prefills, tables)]
    return input_ids, AttentionMetadata(prefills=seqs, **fields), (tuple(rest[-2:]) if embeds else None)


def encode_reply(rank: int, state: str, error: str = "", handle: bytes = b"") -> bytes:
    return msgpack.packb({"rank": rank, "state": state, "error": error, "handle": handle})


def decode_reply(frame: bytes) -> dict:
    """Raises MessageError: not a reply."""
    try:
        reply = msgpack.unpackb(frame)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MessageError(f"not a rank reply: {exc}") from None
    if not isinstance(reply, dict) or not {"rank", "state", "error", "handle"} <= reply.keys():
        raise MessageError("not a rank reply: no rank, state, error or handle")
    if not isinstance(reply["handle"], bytes):
        raise MessageError(f"a rank reply's handle is {type(reply['handle']).__name__}, not bytes")
    return reply
