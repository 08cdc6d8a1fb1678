"""Framework integrations of the exact uneven split (Megatron-LM, DeepSpeed, Ray Train, Alpa).

Each module imports its framework lazily (inside functions), so importing this package needs
neither torch nor the frameworks. See docs/training.md for what is tested per framework.
"""
