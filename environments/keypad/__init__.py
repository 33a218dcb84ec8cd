"""`keypad`: type the code shown; learnable by a randomly initialised tiny model under RL."""
