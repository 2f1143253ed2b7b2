"""The MoE block: router -> permute -> experts -> un-permute, and its losses."""

from nodrop.moe.block import ExpertBias, MoEAux, MoEBlock, MoEConfig, updated_expert_bias
from nodrop.moe.losses import (load_balancing_loss, router_z_loss, sequence_balance_loss,
                               tokens_per_expert)

__all__ = [
    "ExpertBias", "MoEAux", "MoEBlock", "MoEConfig", "load_balancing_loss", "router_z_loss",
    "sequence_balance_loss", "tokens_per_expert", "updated_expert_bias",
]
