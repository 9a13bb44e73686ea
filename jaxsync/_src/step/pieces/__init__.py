"""What one loss call on a piece of the global batch means: its weight, its random
stream, and how its aux and model state combine into the one-device value."""
