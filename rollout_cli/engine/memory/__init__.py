"""GPU memory: release and resume for a trainer, and how the KV and state pools are sized."""
