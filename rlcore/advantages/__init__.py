"""rlcore.advantages"""
