"""The tiny models' warm-up recipes: how the shipped weights (models/embedded/, models/embedded_tools/,
models/embedded_games/, models/embedded_vision/, checked by models/shipped.py) were built, and the build of any
other seed or size.

    arith.py   the embedded tiny model: from scratch, supervised on two-number addition
    tools.py   that model supervised on calculator conversations (the tool-use demonstration)
    games.py   that model supervised on number-guessing games (the multi-turn game demonstration)
    vision.py  tiny random vision-language models (Qwen2.5-VL, Idefics3) for tests, built offline
    vision_model.py  that model inside a Qwen2.5-VL, taught to read digits in an image (the VLM demonstration)

A floor above models/, rollout/, data/ and tools/, which the recipes train with.
"""
