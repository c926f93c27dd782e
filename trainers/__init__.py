"""RL training side: PPO/GRPO losses (pure tensor functions), the experience batch, and the loops.

Nothing here reaches into runner/ internals; trainers talk to the rollout Engine API only.
"""
