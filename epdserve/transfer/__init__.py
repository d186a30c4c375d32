"""Moving tensors between workers: frames, the KV codec, shared memory, CUDA IPC, TCP, the
table of live exports, the layer pipeline, the KV hand-off and frame sealing.
"""

__all__ = ["cuda_ipc", "descriptor", "embedding", "exports", "handoff", "kv_codec",
           "loopback", "pipeline", "pooled", "sealing", "shm", "tcp", "wire"]
