"""Pure-PyTorch algorithm parts: local trainers, update transforms, server rules, presets."""
