"""posttrain.rewards"""
