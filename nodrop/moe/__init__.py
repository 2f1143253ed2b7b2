"""The MoE block: router -> permute -> experts -> un-permute, and its losses."""

from nodrop.moe.losses import load_balancing_loss, router_z_loss, tokens_per_expert

__all__ = ["load_balancing_loss", "router_z_loss", "tokens_per_expert"]
