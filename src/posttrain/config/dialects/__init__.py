"""Other frameworks' configs read as posttrain's: each dialect translates its keys (a layer of flat keys, or a
file's tree and its overrides) into posttrain's keys in one pass, before config/load.py checks them and merges
them onto the schema. A dialect imports config's schema, checks and flat-key helpers (config/flat.py), never
config/load.py.

    verl/      verl's RL, SFT and fully asynchronous trainers' keys
    nemo_rl/   NeMo-RL's files (`defaults:`), Hydra-style overrides and layouts: GRPO, PPO, SFT, distillation
"""
