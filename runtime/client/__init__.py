"""The forwarding client: remote tensors, the connection, the ``remote`` device, CUDA emulation
and the client's trace. It runs where no GPU is and never imports the server or sharing
(tests/unit/test_layers.py holds that)."""
