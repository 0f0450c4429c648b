"""A step on the device: the model runner, attention over the KV pool, CUDA graphs, sampling, routing capture."""
