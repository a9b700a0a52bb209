"""shardrl: RL post-training for dense and MoE LLMs on plain torch.distributed."""

__version__ = "0.1.0"
