"""Model files per architecture family on shared layers, and the safetensors loader."""
