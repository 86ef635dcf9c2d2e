"""What a run reports while it runs: metrics rows (JSONL, TensorBoard), the Weights & Biases sink,
compile events, and the console's one line per step."""
