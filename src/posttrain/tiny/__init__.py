"""The tiny models' warm-up recipes: how the shipped weights (models/embedded/, models/embedded_tools/,
models/embedded_games/, checked by models/shipped.py) were built, and the build of any other seed or size.

    arith.py   the embedded tiny model: from scratch, supervised on two-number addition
    tools.py   that model supervised on calculator conversations (the tool-use demonstration)
    games.py   that model supervised on number-guessing games (the multi-turn game demonstration)

A floor above models/, rollout/, data/ and tools/, which the recipes train with.
"""
