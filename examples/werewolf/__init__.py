"""A one-day Werewolf vote: four villagers (trained) against two wolves (a frozen opponent)."""
