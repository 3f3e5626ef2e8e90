"""posttrain.models"""
