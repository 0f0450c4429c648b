"""Engine: requests, scheduler, KV pool, prefix cache, model runner, sampler."""
