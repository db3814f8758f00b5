"""Model definitions (plain PyTorch). Models meant for DP use GroupNorm, never BatchNorm."""
