"""Engine builds: check the parts, pick the backend, profile D-cut, write the manifest; the
TensorRT-LLM export folder."""
