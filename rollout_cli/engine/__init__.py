"""Engine: the Python API and its step loop (here), scheduling/ (which requests run, prefix cache,
sessions), execution/ (the forward, attention over the KV pool, CUDA graphs, sampling, routing
capture), weights/ (updates), memory/ (release and resume, pool sizing). README: How it works."""
