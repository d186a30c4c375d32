"""The control messages between rank 0 of a tensor-parallel worker and its follower ranks
(:mod:`epdserve.serving.worker.ranks`): ZeroMQ multipart messages of a msgpack header and one
raw frame per tensor, never pickle.

Rank 0 → a follower (a PUSH socket of rank 0's per follower). The header is a map with
``op``, ``tensors`` (``[[dtype name, shape], ...]``, one per frame after the header, in
order) and the op's own fields:

* ``init``: ``num_blocks``, ``block_size``, ``shape`` (the whole worker's KV cache,
  every KV head), ``dtype`` (the cache's: ``float32`` or ``bfloat16``), ``split`` (each
  rank's KV heads) and ``pool``: the /dev/shm pool whose part of this rank's index is its
  KV cache (``transfer.shm.map_part``), or None to allocate its own (CUDA), shared with
  rank 0 by the ``ready``'s handle (no tensors);
* ``hidden_states`` / ``forward``: one step, with the arguments of
  ``LlamaModel.hidden_states``: ``prefills`` (``[[start, q_len, ctx_len], ...]``) and
  ``embeds`` (bool); tensors ``input_ids``, ``positions``, ``slot_mapping``,
  ``decode_rows``, ``decode_block_tables``, ``decode_ctx_lens``, ``logits_rows``, each
  prefill's ``block_table``, then, with ``embeds``, the embedding rows and values;
* ``logits``: one tensor, the hidden rows ``[R, hidden]``;
* ``encode`` (an encode worker's vision ranks): one tensor, the image tiles' pixel values
  ``[N, 3, H, W]``;
* ``stop``: leave (no tensors).

A follower → rank 0 (one PUSH socket each, into rank 0's PULL): one msgpack frame
``{"rank": r, "state": "loaded" | "ready" | "error", "error": text, "handle": bytes}``;
``handle``: on CUDA, the ``ready`` of a follower whose KV cache rank 0 opens by CUDA IPC
(``transfer.cuda_ipc.pack_handle``, checked by ``unpack_handle``), else empty.

A tensor travels as its bytes in row-major order (bfloat16 as a ``uint8`` view, which
NumPy lacks), on the host: a GPU rank's tensors are copied out and back.
"""

from __future__ import annotations

import msgpack
import torch

from epdserve.model.llama import AttentionMetadata, PrefillSeq

# The dtypes a message may carry, by name (anything else is refused on decode).
DTYPES = {name: getattr(torch, name) for name in ("int64", "int32", "float32", "bfloat16", "float16", "uint8", "bool")}
STEP_OPS = ("hidden_states", "forward")
META_FIELDS = ("positions", "slot_mapping", "decode_rows", "decode_block_tables", "decode_ctx_lens", "logits_rows")

Step = tuple[torch.Tensor, AttentionMetadata, tuple[torch.Tensor, torch.Tensor] | None]


class MessageError(ValueError):
    """A control message that does not decode (a bug, or a frame from something else)."""


def _tensor_frame(t: torch.Tensor) -> tuple[list, bytes | memoryview]:
    """``([dtype name, shape], raw bytes)`` of ``t`` (copied to the host first)."""
    t = t.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise MessageError(f"a tensor of {t.dtype} cannot be sent to another rank")
    data = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
    return [name, list(t.shape)], data


def _tensor(spec, frame: bytes) -> torch.Tensor:
    """The tensor of a ``[dtype name, shape]`` spec and its frame's bytes."""
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
    """The frames of a message: its header (``op``, the tensors' specs, ``fields``), then
    each tensor's bytes."""
    specs, data = zip(*(_tensor_frame(t) for t in tensors)) if tensors else ((), ())
    return [msgpack.packb({"op": op, "tensors": list(specs), **fields}), *data]


def decode(frames: list[bytes]) -> tuple[dict, list[torch.Tensor]]:
    """``(header, tensors)`` of a message's frames.

    Raises:
        MessageError: a header that is not a msgpack map with ``op`` and ``tensors``, or
            frames that do not match it.
    """
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
    """The frames of a ``hidden_states`` or ``forward`` call (see the module doc)."""
    tensors = [input_ids, *(getattr(meta, name) for name in META_FIELDS), *(p.block_table for p in meta.prefills),
               *(embeds or ())]
    return encode(op, tensors, prefills=[[p.start, p.q_len, p.ctx_len] for p in meta.prefills],
                  embeds=embeds is not None)


def decode_step(header: dict, tensors: list[torch.Tensor]) -> Step:
    """``(input_ids, meta, embeds)`` of a decoded step message (on the host).

    Raises:
        MessageError: the tensors do not match the header's prefills and embeds.
    """
    prefills, embeds = header.get("prefills"), header.get("embeds")
    if not isinstance(prefills, list) or len(tensors) != 1 + len(META_FIELDS) + len(prefills) + 2 * bool(embeds):
        raise MessageError(f"{header['op']}: {len(tensors)} tensors do not match its prefills and embeds")
    input_ids, *rest = tensors
    fields = dict(zip(META_FIELDS, rest))
    tables = rest[len(META_FIELDS):len(META_FIELDS) + len(prefills)]
    seqs = [PrefillSeq(start=s, q_len=q, ctx_len=c, block_table=t) for (s, q, c), t in zip(prefills, tables)]
    return input_ids, AttentionMetadata(prefills=seqs, **fields), (tuple(rest[-2:]) if embeds else None)


def encode_reply(rank: int, state: str, error: str = "", handle: bytes = b"") -> bytes:
    """A follower's answer (see the module doc)."""
    return msgpack.packb({"rank": rank, "state": state, "error": error, "handle": handle})


def decode_reply(frame: bytes) -> dict:
    """A follower's answer as a dict with ``rank``, ``state``, ``error`` and ``handle``.

    Raises:
        MessageError: not one.
    """
    try:
        reply = msgpack.unpackb(frame)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MessageError(f"not a rank reply: {exc}") from None
    if not isinstance(reply, dict) or not {"rank", "state", "error", "handle"} <= reply.keys():
        raise MessageError("not a rank reply: no rank, state, error or handle")
    if not isinstance(reply["handle"], bytes):
        raise MessageError(f"a rank reply's handle is {type(reply['handle']).__name__}, not bytes")
    return reply
