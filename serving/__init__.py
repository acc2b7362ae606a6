"""Serving: install, start and stop tritonserver, fill the model repository for an engine, and
the tritonclient client."""
