"""Moving tensors between workers: frames, shared memory, CUDA IPC, TCP, the KV hand-off, frame sealing."""

__all__ = ["cuda_ipc", "descriptor", "embedding", "exports", "handoff", "kv_codec",
           "loopback", "pipeline", "pooled", "sealing", "shm", "tcp", "wire"]
