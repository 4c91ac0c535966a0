"""rlcore.rewards"""
