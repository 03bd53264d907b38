"""What the front of `gpu-trace serve` and its worker processes say to each other (no torch)."""
