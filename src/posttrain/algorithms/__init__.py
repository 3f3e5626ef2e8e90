"""posttrain.algorithms"""
