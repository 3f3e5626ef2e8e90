"""posttrain.rollout"""
