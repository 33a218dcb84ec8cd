"""BabyAI: minigrid's BabyAI levels as text, with AgentGym's macro actions (see `env.py`)."""
