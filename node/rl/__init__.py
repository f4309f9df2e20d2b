"""The RL loop's pieces that do not touch the network: rollouts, rewards, the in-process loop."""
