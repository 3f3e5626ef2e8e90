"""posttrain.data.preprocess"""
