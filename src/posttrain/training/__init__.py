"""posttrain.training"""
