"""Following the trainer's weights: the reload loop, sharded and LoRA-adapter loading."""
