"""Multi-LoRA serving (issue 46): adapter requests, PEFT adapter loading, and the batched low-rank update."""
