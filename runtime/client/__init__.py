"""The forwarding client: remote tensors, the connection, the ``remote`` device, CUDA emulation
and the client's trace. It runs where no GPU is and never imports the server, sharing, the
channel or a worker (tests/unit/test_runtime_layers.py holds that)."""
