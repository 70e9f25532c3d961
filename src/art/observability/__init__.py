"""Optional metric sinks. history.jsonl (art.storage) is always written; these add to it."""

from art.observability.wandb_sink import finish_wandb, log_to_wandb, update_config as update_wandb_config, wandb_enabled

__all__ = ["finish_wandb", "log_to_wandb", "update_wandb_config", "wandb_enabled"]
