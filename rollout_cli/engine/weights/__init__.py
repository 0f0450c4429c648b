"""Weight updates: from disk, from tensors (in process, CUDA IPC, shared memory), by broadcast."""
