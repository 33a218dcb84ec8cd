"""TextCraft: craft a Minecraft item from given crafting commands (see `env.py`)."""
