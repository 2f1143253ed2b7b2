"""The training job behind `nodrop train` and `nodrop compare` (see trainer.py for the loop)."""
